"""Amortised O(1) appends to the global KV rows of a state, without ever changing what a tensor shows.

A decode step adds one entry to every ratio-1 source; `torch.cat` of the whole history for it made a step
cost O(N) in copies (at 64K tokens on v41-sib-l, 41% of a decode step's CPU time was `aten::cat`).
`append_rows` instead writes the new rows into spare capacity behind the old rows and returns a longer
view of the same buffer, as a Python list grows.

Why this keeps the state contract (model/state.py: a forward never mutates a tensor in place, so a
snapshot stays valid): the rows written lie past the end of every view handed out so far, so no existing
tensor's values change. Only the newest view (the buffer's *tip*, recognised by identity) may append in
place. A snapshot that shares that view and appends second finds the buffer already longer than its view
and copies into a buffer of its own, so two continuations of one state never write the same rows.

Used only when nothing needs autograd (an in-place write into a graph tensor would break backward) and
for batch 1 (a slice along dim 1 of a [1, C, D] buffer stays contiguous; batch > 1 keeps `torch.cat`).
"""

from __future__ import annotations

import threading

import torch

__all__ = ["append_rows", "append_rows_reference"]

# Spare capacity on a re-allocation: half the rows again, at least this many (decode then copies once
# per ~N/2 steps; a prefill chunk larger than the slack gets exactly what it needs plus the slack).
_MIN_SLACK_ROWS = 256

# The attribute a tip view carries: its buffer's record. Set only on views this module returns.
_TIP = "_kvresume_append_tip"


class _Buffer:
    """A [1, capacity, ...] allocation and how many of its rows hold data (the tip view's length)."""

    def __init__(self, data: torch.Tensor, used: int) -> None:
        self.data = data
        self.used = used
        self.lock = threading.Lock()


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


def _tip_view(buf: _Buffer) -> torch.Tensor:
    view = buf.data[:, : buf.used]
    setattr(view, _TIP, buf)
    return view


def append_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """old [1, n, ...] ++ new [1, k, ...] along dim 1, equal to `append_rows_reference` element for element.

    In place (into spare capacity) when `old` is the tip of its buffer; otherwise a copy into a new
    buffer with slack, whose tip the result is. Tensors of batch > 1 or that need grad are concatenated.
    """
    if not _eligible(old, new):
        return append_rows_reference(old, new)
    n, k = old.size(1), new.size(1)
    if k == 0:
        return old
    buf: _Buffer | None = getattr(old, _TIP, None)
    if buf is not None:
        with buf.lock:
            # an inference tensor may only be written inside inference mode (and a normal one is kept
            # out of it), so a state made under one mode and continued under the other copies once
            same_mode = buf.data.is_inference() == torch.is_inference_mode_enabled()
            if buf.used == n and n + k <= buf.data.size(1) and same_mode:
                buf.data[:, n : n + k] = new
                buf.used = n + k
                return _tip_view(buf)
    capacity = n + k + max(_MIN_SLACK_ROWS, (n + k) // 2)
    data = old.new_empty((1, capacity, *old.shape[2:]))
    data[:, :n] = old
    data[:, n : n + k] = new
    return _tip_view(_Buffer(data, n + k))
