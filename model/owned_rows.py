"""Rows written into the ring tensors that one state alone holds, instead of a fresh tensor per state and
field every decode step.

The state contract (model/state.py) is that a pass replaces a state's tensors and never writes into one,
so that a snapshot (`ModelState.clone`, which shares them) stays valid. A batched decode step kept it by
giving every sequence new rings each step: the window ring and its stored form per layer, the encoder-output
ring, the compressor's open-group carries, each a stacked write cut apart into N fresh tensors (about
50 us a sequence a step on v41-sib-s, measured in session 33: 2.5 of 29 ms for 46 sequences).

Here a tensor that a batched step made for one state is marked with that state's `owner` token, and a
later step of the same state writes its new row into it at the row's slot: all the rows of one field for
every sequence in one `copy_blocks` call. `ModelState.clone` gives the state and its copy new tokens, so
that after a snapshot neither writes into what the other still shows; the first step after it makes fresh
tensors again (and marks them). Any other way a tensor gets into a state (an import, a lone pass, a view of
another state's) leaves it unmarked, and unmarked tensors are never written.

Knows nothing of layers or attention: `model/batched.py` and `model/batched_attention.py` say which tensors
and slots; `write_ring_rows` writes them (or makes the fresh tensors), `write_rows` is its copy by address.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import torch

from kernels import copy_blocks, copy_blocks_available

__all__ = ["mark_owned", "owns", "write_ring_rows", "write_rows"]

# The attribute an owned tensor carries: the `owner` token of the one state it belongs to.
_OWNER = "_kvresume_owner"


def mark_owned(owner: object, tensors: Iterable[torch.Tensor]) -> None:
    """Mark fresh tensors, made for one state and shown to no other, as that state's (`owner`: its token)."""
    for t in tensors:
        setattr(t, _OWNER, owner)


def owns(owner: object, t: torch.Tensor | None) -> bool:
    """Whether `t` was marked for the state whose token is `owner` (and so no other state shows it)."""
    return getattr(t, _OWNER, None) is owner


def write_rows(dsts: Sequence[torch.Tensor], slots: Sequence[int], rows: torch.Tensor, *,
               native: bool | None = None) -> None:  # fmt: skip
    """dsts[i][0, slots[i]] = rows[i] for every i: one new row into each of N owned tensors.

    Args:
        dsts: N contiguous tensors [1, R, ...] alike (rows' dtype and device, [0, slot] a row's shape),
            distinct (no two share memory).
        slots: the row of each destination to write, in [0, R).
        rows: [N, ...] the new rows.
        native: with the compiled `copy_blocks` (CPU, addresses: no view per destination) or with
            `torch._foreach_copy_` into views (False: the slow twin); None: the compiled one where it loads.
            Either writes the same bytes.

    Raises:
        ValueError: counts, shapes, dtypes or slots that do not fit (checked before anything is written).
    """
    n = len(dsts)
    if len(slots) != n or rows.size(0) != n:
        raise ValueError(f"write_rows needs one slot and one row per destination, got {n} destinations, "
                         f"{len(slots)} slots and rows {tuple(rows.shape)}")  # fmt: skip
    if not n:
        return
    # Checked on the first destination only (per destination it would cost about what the write saves):
    # the callers pass tensors that `mark_owned` marked, which batched steps make alike for one field.
    d, high = dsts[0], dsts[0].size(1)
    if (d.dim() != rows.dim() + 1 or d.size(0) != 1 or d.shape[2:] != rows.shape[1:] or d.dtype != rows.dtype
            or d.device != rows.device or not d.is_contiguous() or min(slots) < 0 or max(slots) >= high):
        raise ValueError(f"write_rows: destinations like {tuple(d.shape)} {d.dtype} at slots "
                         f"{list(slots)} do not take rows {tuple(rows.shape)} {rows.dtype}")  # fmt: skip
    if native is None:
        native = copy_blocks_available()
    if native and rows.device.type == "cpu":
        src = rows.contiguous()
        row_bytes = src.numel() // n * src.element_size()
        base = src.data_ptr()
        # the tensors in `dsts` and `src` stay alive until copy_blocks returns
        dst_at = array("q", [d.data_ptr() + s * row_bytes for d, s in zip(dsts, slots, strict=True)])
        copy_blocks(dst_at, array("q", range(base, base + n * row_bytes, row_bytes)), row_bytes)
    else:
        torch._foreach_copy_([d[0, s] for d, s in zip(dsts, slots, strict=True)], list(rows.unbind(0)))


def write_ring_rows(
    rings: Sequence[Sequence[torch.Tensor]],
    new: Sequence[torch.Tensor],
    slots: Sequence[int],
    owners: Sequence[object],
    *,
    in_place: bool,
) -> tuple[list[int], list[list[torch.Tensor]]]:
    """One new row into each of N states' rings, for F fields at once.

    Args:
        rings: per field, the [1, R, ...] tensor each state holds (`rings[f][i]`: field f of state i).
        new: per field, the new rows [N, ...], row i for state i.
        slots: the row of each state's rings to write.
        owners: each state's `owner` token.
        in_place: write into the rings of the states that own every field's tensor (`owns`); False:
            fresh tensors for every state (the slow twin).

    Returns:
        The states that got fresh tensors instead (in order) and, per field, those tensors: the rings with
        the row written, made in one stacked write per field and cut apart (`split_copy`: each its own
        storage), and marked as each state's own when `in_place`. The caller puts them into the states;
        the rings written in place are the tensors the states hold already.
    """
    n = len(owners)
    mine = [i for i in range(n) if in_place and all(owns(owners[i], r[i]) for r in rings)]
    if mine:
        at = slice(None) if len(mine) == n else torch.tensor(mine, device=new[0].device)
        where = [slots[i] for i in mine]
        for r, rows in zip(rings, new, strict=True):
            write_rows([r[i] for i in mine], where, rows[at])
    if len(mine) == n:
        return [], [[] for _ in rings]
    taken = set(mine)
    rest = [i for i in range(n) if i not in taken]
    dev = new[0].device
    g = torch.tensor(rest, device=dev) if mine else slice(None)
    every = torch.arange(len(rest), device=dev)
    where_t = torch.tensor([slots[i] for i in rest], device=dev)
    fresh: list[list[torch.Tensor]] = []
    for r, rows in zip(rings, new, strict=True):
        stacked = torch.cat([r[i] for i in rest])  # [len(rest), R, ...] (fresh: cat copies)
        stacked[every, where_t] = rows[g]
        cut = list(torch.split_copy(stacked, 1))
        if in_place:
            for i, t in zip(rest, cut, strict=True):
                mark_owned(owners[i], (t,))
        fresh.append(cut)
    return rest, fresh
