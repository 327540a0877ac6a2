"""Amortised O(1) appends to the global KV rows of a state, without ever changing what a tensor shows.

A decode step adds one entry to every ratio-1 source; `torch.cat` of the whole history for it made a step
cost O(N) in copies (at 64K tokens on v41-sib-l, 41% of a decode step's CPU time was `aten::cat`).
`append_rows` instead writes the new rows into spare capacity behind the old rows and returns a longer
view of the same buffer, as a Python list grows.

Why this keeps the state contract (model/state.py: a forward never changes a tensor that a snapshot
shows, so a snapshot stays valid): the rows written lie past the end of every view handed out so far, so
no existing tensor's values change. Only the newest view (the buffer's *tip*, recognised by identity) may
append in place. A snapshot that shares that view and appends second finds the buffer already longer than
its view and copies into a buffer of its own, so two continuations of one state never write the same rows.

Used only when nothing needs autograd (an in-place write into a graph tensor would break backward) and
for batch 1 (a slice along dim 1 of a [1, C, D] buffer stays contiguous; batch > 1 keeps `torch.cat`).

`append_rows_many` is the batched form for a step over many sequences (one new row each for 64 sequences
and 6 source fields was about 650 `append_rows` calls per decode step): it decides every append as
`append_rows` would, in order, and writes all the in-place rows of CPU buffers with one call of the
compiled `copy_blocks` (kernels/native/blocks.py: addresses, no view per destination), elsewhere or without
a compiler with one `torch._foreach_copy_` into views (its slow twin; both are tested against the other).
`append_rows_ragged` is the same for runs of unequal lengths (a batched prefill's new entries: each chunk
closes its own number of compression groups), one `copy_blocks` call per run length.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence

import torch

from kernels import copy_blocks, copy_blocks_available

__all__ = ["append_rows", "append_rows_many", "append_rows_ragged", "append_rows_reference"]

# Spare capacity on a re-allocation: half the rows again, at least this many (decode then copies once
# per ~N/2 steps; a prefill chunk larger than the slack gets exactly what it needs plus the slack).
_MIN_SLACK_ROWS = 256

# The attribute a tip view carries: its buffer's record. Set only on views this module returns.
_TIP = "_kvresume_append_tip"

# Guards every buffer's `used` (a claim reads and moves it): one lock for all buffers, so that a batched
# append claims the rows of all its sequences under one acquisition (a lock per buffer cost an acquisition
# per sequence and field: about 2% of a 64-sequence prefill step). A claim is a few comparisons, so
# appends to different buffers from different threads barely wait for each other.
_CLAIMS = threading.Lock()


class _Buffer:
    """A [1, capacity, ...] allocation and how many of its rows hold data (the tip view's length)."""

    def __init__(self, data: torch.Tensor, used: int) -> None:
        self.data = data
        self.used = used
        # what an append checks and the views it makes, kept once: `as_strided` with known strides is
        # the cheapest view torch makes (a slice costs about twice as much), and a step makes hundreds
        self.key = (data.dtype, data.device, tuple(data.shape[2:]))
        self.strides = data.stride()
        self.inference = data.is_inference()
        # where row r starts in memory: address + r * row_bytes (the buffer is contiguous, rows dense)
        self.address = data.data_ptr()
        self.row_bytes = self.strides[1] * data.element_size()

    def tip(self) -> torch.Tensor:
        """The view of rows [0, used): `data[:, :used]`, marked as this buffer's tip."""
        view = self.data.as_strided((1, self.used, *self.key[2]), self.strides)
        setattr(view, _TIP, self)
        return view

    def rows(self, start: int, count: int) -> torch.Tensor:
        """`data[:, start : start + count]`, where an append writes."""
        return self.data.as_strided((1, count, *self.key[2]), self.strides, start * self.strides[1])


def append_rows_reference(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The slow twin: a fresh concatenation along dim 1."""
    return torch.cat([old, new], dim=1)


def _eligible(old: torch.Tensor, new: torch.Tensor) -> bool:
    return (
        old.size(0) == 1
        and new.size(0) == 1
        and old.dtype == new.dtype
        and old.device == new.device
        and old.shape[2:] == new.shape[2:]
        and not (old.requires_grad or new.requires_grad)
    )


def _fits(tip: _Buffer, old: torch.Tensor, new: torch.Tensor) -> bool:
    """`_eligible(old, new)` for `old` a tip of `tip` (batch 1, the buffer's dtype, device and row shape)."""
    return (
        new.size(0) == 1
        and tip.key == (new.dtype, new.device, tuple(new.shape[2:]))
        and not (old.requires_grad or new.requires_grad)
    )


def _claim_held(buf: _Buffer, n: int, k: int, inference: bool) -> bool:
    """Reserve rows [n, n + k) of `buf` for an append to its view of n rows (`_CLAIMS` held): True when
    that view is the buffer's tip and the rows fit (its tip moves to n + k); else False (the caller copies).

    Writing the reserved rows after the lock is released is safe: they lie past every view handed out so
    far, and a second appender of the same view now finds the buffer longer than it and copies rows [0, n).
    """
    # an inference tensor may only be written inside inference mode (and a normal one is kept out of
    # it), so a state made under one mode and continued under the other copies once
    if buf.used == n and n + k <= buf.data.size(1) and buf.inference == inference:
        buf.used = n + k
        return True
    return False


def _claim(old: torch.Tensor, k: int, inference: bool) -> _Buffer | None:
    """The buffer of `old` with rows [n, n + k) reserved for this append, when `old` is that buffer's tip
    and the rows fit (`_claim_held`); else None (the caller copies)."""
    buf: _Buffer | None = getattr(old, _TIP, None)
    if buf is None:
        return None
    with _CLAIMS:
        return buf if _claim_held(buf, old.size(1), k, inference) else None


def _regrown(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """old ++ new copied into a fresh buffer with slack; the result is its tip."""
    n, k = old.size(1), new.size(1)
    capacity = n + k + max(_MIN_SLACK_ROWS, (n + k) // 2)
    data = old.new_empty((1, capacity, *old.shape[2:]))
    data[:, :n] = old
    data[:, n : n + k] = new
    return _Buffer(data, n + k).tip()


def append_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """old [1, n, ...] ++ new [1, k, ...] along dim 1, equal to `append_rows_reference` element for element.

    In place (into spare capacity) when `old` is the tip of its buffer; otherwise a copy into a new
    buffer with slack, whose tip the result is. Tensors of batch > 1 or that need grad are concatenated.
    """
    tip: _Buffer | None = getattr(old, _TIP, None)
    # a tip is batch 1 with its buffer's dtype, device and row shape: comparing the key checks the rest
    if tip is None or not _fits(tip, old, new):
        if not _eligible(old, new):
            return append_rows_reference(old, new)
    n, k = old.size(1), new.size(1)
    if k == 0:
        return old
    buf = _claim(old, k, torch.is_inference_mode_enabled()) if tip is not None else None
    if buf is None:
        return _regrown(old, new)
    buf.rows(n, k).copy_(new)
    return buf.tip()


def append_rows_many(
    olds: Sequence[torch.Tensor], new: torch.Tensor, *, native: bool | None = None
) -> list[torch.Tensor]:
    """`[append_rows(olds[g], new[g : g + 1]) for g]` (the twin: equal element for element, with the same
    appends in place, decided in order), writing the in-place rows of all G sequences in one call.

    Args:
        olds: G tensors [1, n_g, ...] (their own histories; lengths may differ).
        new: [G, k, ...] the rows to append to each.
        native: write the in-place rows of CPU buffers with the compiled `copy_blocks` (True) or with
            `torch._foreach_copy_` into views (False, the slow twin); None: the compiled one where it
            loads. Either gives the same tensors.

    Raises:
        ValueError: new is not [G, k, ...] for the G tensors given.
    """
    if new.dim() < 2 or new.size(0) != len(olds):
        raise ValueError(f"append_rows_many needs new [G={len(olds)}, k, ...], got {tuple(new.shape)}")
    g, k = new.size(0), new.size(1)
    return _append_runs(olds, new.reshape(1, g * k, *new.shape[2:]), [k] * g, native)


def append_rows_ragged(
    olds: Sequence[torch.Tensor], new: torch.Tensor, counts: Sequence[int], *, native: bool | None = None
) -> list[torch.Tensor]:
    """`append_rows_many` for runs of unequal lengths: `[append_rows(olds[i], new[:, a_i : a_i + counts[i]])
    for i]`, where new [1, sum(counts), ...] holds each sequence's rows after the previous one's (a_i =
    counts[0] + ... + counts[i - 1]); a count of 0 leaves its tensor as it is. `native` as there.

    Raises:
        ValueError: new is not [1, sum(counts), ...], a count is negative, or counts and olds differ in
            number.
    """
    if len(counts) != len(olds) or any(c < 0 for c in counts):
        raise ValueError(f"append_rows_ragged needs a count >= 0 for each of the {len(olds)} tensors, got "
                         f"{list(counts)}")  # fmt: skip
    if new.dim() < 2 or new.size(0) != 1 or new.size(1) != sum(counts):
        raise ValueError(
            f"append_rows_ragged needs new [1, {sum(counts)}, ...] for counts {list(counts)}, got "
            f"{tuple(new.shape)}"
        )
    return _append_runs(olds, new, counts, native)


def _append_runs(
    olds: Sequence[torch.Tensor], new: torch.Tensor, counts: Sequence[int], native: bool | None
) -> list[torch.Tensor]:
    """The appends of `append_rows_ragged` (arguments checked): every claim decided in order under one
    acquisition, then the claimed rows written in one call per run length."""
    key = (new.dtype, new.device, tuple(new.shape[2:]))
    inference = torch.is_inference_mode_enabled()
    fast = not new.requires_grad
    # every claim under one acquisition, in order (as one append after the other would decide them)
    claims: list[tuple[_Buffer, int] | None] = []
    with _CLAIMS:
        for old, k in zip(olds, counts, strict=True):
            tip: _Buffer | None = getattr(old, _TIP, None)
            claim = None
            # as `_fits`, with new's part checked once
            if k and fast and tip is not None and tip.key == key and not old.requires_grad:
                n = old.size(1)
                claim = (tip, n) if _claim_held(tip, n, k, inference) else None
            claims.append(claim)
    if native is None:
        native = copy_blocks_available()
    native = native and new.device.type == "cpu"
    rows = new.contiguous() if native else new
    out: list[torch.Tensor] = []
    claimed: list[tuple[int, int, _Buffer, int]] = []  # (first row in `rows`, count, buffer, rows it held)
    at = 0
    for old, k, claim in zip(olds, counts, claims, strict=True):
        if claim is None:
            out.append(append_rows(old, rows[:, at : at + k]))
        else:
            claimed.append((at, k, *claim))
            out.append(claim[0].tip())
        at += k
    if claimed:
        if native:
            _write_by_address(rows, claimed)
        else:
            dst = [buf.rows(n, k) for _, k, buf, n in claimed]
            torch._foreach_copy_(dst, [rows[:, a : a + k] for a, k, _, _ in claimed])
    return out


def _write_by_address(rows: torch.Tensor, claimed: Sequence[tuple[int, int, _Buffer, int]]) -> None:
    """Write each claim's rows of a contiguous CPU `rows` [1, S, ...] (k of them from row a) into rows
    [n, n + k) of its buffer with one `copy_blocks` call per run length k.

    Safe: a claimed block lies inside its buffer (the claim checked the capacity), blocks of different
    buffers never overlap, no view handed out shows those rows yet, and `rows` and every buffer stay alive
    until the call returns."""
    row_bytes = claimed[0][2].row_bytes  # bytes of one row (new's row shape and dtype)
    base = rows.data_ptr()
    groups: dict[int, list[tuple[int, int, _Buffer, int]]] = {}
    for claim in claimed:
        groups.setdefault(claim[1], []).append(claim)
    for k, group in groups.items():
        dst_at = array("q", [buf.address + n * row_bytes for _, _, buf, n in group])
        src_at = array("q", [base + a * row_bytes for a, _, _, _ in group])
        copy_blocks(dst_at, src_at, k * row_bytes)
