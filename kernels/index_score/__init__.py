"""Lightning-indexer scores, sum_h w·relu(q·k), with optional visibility/candidate masks: `index_score`.

`reference.py` is the ground truth (bitwise equal to the official reference on CPU); `cpu.py` is its
compiled CPU twin for the full scan (bitwise equal to it under the portable numerics profile; the torch
backend takes it on CPU when it builds); `triton.py` is the CUDA kernel (also runs under
TRITON_INTERPRET=1), equal to it up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from kernels.index_score import cpu
from kernels.index_score.reference import index_score_at_reference, index_score_reference

__all__ = ["index_score", "index_score_at", "index_score_rows"]

_BACKENDS = ("torch", "triton")


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    visible: torch.Tensor | None,
    candidates: torch.Tensor | None,
) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {tuple(q.shape)}")
    b, t, h, d = q.shape
    if k.dim() != 3 or k.size(0) != b or k.size(2) != d:
        raise ValueError(f"k must be [B={b}, N, D={d}], got shape {tuple(k.shape)}")
    if weights.shape != (b, t, h):
        raise ValueError(f"weights must be [B={b}, T={t}, H={h}], got shape {tuple(weights.shape)}")
    for name, x in (("q", q), ("k", k), ("weights", weights)):
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bf16, got {x.dtype}")
    if visible is not None:
        if visible.shape not in ((t,), (b, t)):
            raise ValueError(f"visible must be [T={t}] or [B={b}, T={t}], got shape {tuple(visible.shape)}")
        if visible.dtype.is_floating_point or visible.dtype == torch.bool:
            raise ValueError(f"visible must be an integer tensor, got {visible.dtype}")
    n = k.size(1)
    if candidates is not None and (candidates.shape != (b, t, n) or candidates.dtype != torch.bool):
        raise ValueError(
            f"candidates must be bool [B={b}, T={t}, N={n}], got {candidates.dtype} {tuple(candidates.shape)}"
        )


def index_score(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    *,
    visible: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Indexer score of every key for every query row, -inf where masked.

    Args:
        q: [B, T, H, D] bf16 index queries (already RoPE'd and MXFP4 QDQ'd).
        k: [B, N, D] bf16 index keys.
        weights: [B, T, H] bf16 head weights, already scaled by D^-0.5 * H^-0.5.
        visible: optional [T] or [B, T] int; key n is masked for row t when n >= visible[.., t]
            (the causal rule: query at position i sees (i + 1) // ratio entries).
        candidates: optional [B, T, N] bool pool from `candidate_blocks`; False is masked (Reindex layers).
        backend: "torch" (the compiled CPU twin on CPU where it builds and covers the head dim, else the
            reference; both give the same bits under the portable profile) or "triton" (CUDA, or CPU under
            TRITON_INTERPRET=1).

    Returns:
        [B, T, N] bf16 scores.

    Raises:
        ValueError: bad shapes or dtypes, or an unknown backend.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    _check_inputs(q, k, weights, visible, candidates)
    if backend == "torch":
        if candidates is None and cpu.usable(q, k):
            scores = cpu.index_score_cpu(q, k, weights, visible)
            if scores is not None:
                return scores
        return index_score_reference(q, k, weights, visible=visible, candidates=candidates)
    # imported here so that importing kernels never imports triton (the interpreter flag must be set first)
    from kernels.index_score.triton import index_score_triton

    return index_score_triton(q, k, weights, visible=visible, candidates=candidates)


def index_score_rows(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    weights: torch.Tensor,
    visible: torch.Tensor,
    *,
    backend: str = "torch",
) -> torch.Tensor:
    """`index_score(q, pad_sequence(keys, batch_first=True), weights, visible=visible)` bit for bit, for B
    sequences whose keys have different lengths (a batched decode's): on CPU with the compiled kernel each
    sequence's row reads its own keys where they lie, instead of a [B, N_max, D] copy padded with zeros.

    Args:
        q: [B, T, H, D] bf16; weights: [B, T, H] bf16 (as `index_score`).
        keys: B tensors [n_i, D] bf16, sequence i's index keys.
        visible: [B, T] int, each at most its sequence's n_i (-inf at and past it, as `index_score`).

    Returns:
        [B, T, max n_i] bf16 scores.

    Raises:
        ValueError: bad shapes or dtypes, keys of another number or head dim than q's, or a visible
            count past its sequence's keys.
    """
    b = q.size(0) if q.dim() == 4 else -1
    if len(keys) != b or b == 0 or any(k.dim() != 2 or k.size(1) != q.size(3) for k in keys):
        raise ValueError(f"index_score_rows needs one [n_i, D] key tensor per batch row of q [B={b}, ...], "
                         f"got {[tuple(k.shape) for k in keys]}")  # fmt: skip
    if visible.dim() != 2 or visible.size(0) != b:
        raise ValueError(f"visible must be [B={b}, T], got shape {tuple(visible.shape)}")
    most = visible.amax(dim=1).tolist() if visible.size(1) else [0] * b
    over = [i for i, (v, k) in enumerate(zip(most, keys, strict=True)) if v > k.size(0)]
    if over:
        i = over[0]
        raise ValueError(f"visible count {most[i]} of sequence {i} is past its {keys[i].size(0)} keys")
    if backend == "torch" and all(k.device.type == "cpu" and k.dtype == torch.bfloat16 for k in keys):
        first = keys[0].unsqueeze(0)
        if cpu.usable(q, first):
            _check_inputs(q, first.expand(b, -1, -1), weights, visible, None)
            scores = cpu.index_score_cpu_rows(q, keys, weights, visible)
            if scores is not None:
                return scores
    padded = pad_sequence(list(keys), batch_first=True)
    return index_score(q, padded, weights, visible=visible, backend=backend)


def index_score_at(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """`index_score` at a few key ids per row (a Reindex layer's candidate pool), torch only.

    Args:
        q: [B, T, H, D] bf16; k: [B, N, D] bf16; weights: [B, T, H] bf16 (as `index_score`).
        ids: [B, T, P] int64 key ids in [-1, N), -1 = empty slot.
        visible: optional [T] or [B, T] int; ids >= visible[.., t] score -inf.

    Returns:
        [B, T, P] bf16: index_score(q, k, weights)[b, t, ids[b, t, p]] bit for bit, -inf at -1 and
        invisible ids.

    Raises:
        ValueError: bad shapes or dtypes.
    """
    _check_inputs(q, k, weights, visible, None)
    b, t = q.shape[:2]
    if ids.dim() != 3 or ids.shape[:2] != (b, t) or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 [B={b}, T={t}, P], got {ids.dtype} {tuple(ids.shape)}")
    return index_score_at_reference(q, k, weights, ids, visible=visible)
