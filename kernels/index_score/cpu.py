"""The compiled CPU path of the indexer scores (cpu_index_score.c): the full scan of `index_score`
bit for bit equal to the torch reference (reference.py, its slow twin) under the portable numerics
profile, NaN payloads aside, about 10x faster at long histories (benchmarks/bench_attention.py).

Knows nothing of validation (the package's `index_score` does it): it takes CPU bf16 tensors of the
reference's shapes. The C file is built on first use by `kernels.native.load_functions`; without a compiler
`usable()` is False and callers keep the reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from kernels.native import load_functions

_SOURCE = Path(__file__).with_name("cpu_index_score.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


@cache
def _library() -> ctypes.CDLL | None:
    return load_functions(_SOURCE, {"index_score_bf16": ([_P, _P, _P, _I64, _INT, _INT, _I64, _P, _P], _INT)})


def covers(head_dim: int, rows: int) -> bool:
    """Whether the C order is the measured ATen order for this shape: head dims 16, 32 and multiples of
    64 (the models use 32; other widths reach ATen tail code the C file does not reproduce: 8, 24, 40 and
    96 were measured to differ), and more than one (row, head) product row (a single one may go to
    ATen's gemv, which was not measured)."""
    return rows > 1 and (head_dim in (16, 32) or head_dim % 64 == 0)


def usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether these inputs can take the compiled path: CPU bf16 tensors of a covered shape and a library
    that builds (q [B, T, H, D], k [B, N, D])."""
    b, t, h, d = q.shape
    return (
        q.device.type == "cpu"
        and k.device.type == "cpu"
        and covers(d, t * h)
        and _library() is not None
    )


def index_score_cpu(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor | None:
    """Scores [B, T, N] bf16 as `index_score_reference(q, k, weights, visible=visible)`, or None when the
    C code could not allocate its scratch memory (the caller then runs the reference).

    q [B, T, H, D], k [B, N, D], weights [B, T, H] bf16 on CPU; visible None, [T] or [B, T] integers.
    """
    k = k.contiguous()
    base, step = k.data_ptr(), k.stride(0) * k.element_size()
    return _scores(q, [base + i * step for i in range(q.size(0))], k.size(1), weights, visible)


def index_score_cpu_rows(
    q: torch.Tensor, keys: Sequence[torch.Tensor], weights: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor | None:
    """`index_score_cpu(q, pad_sequence(keys, batch_first=True), weights, visible)` without the padded
    copy: batch row i's call reads sequence i's own keys where they lie. The kernel reads no key at or past
    a row's visible count (it fills those with -inf), so a sequence's keys need only reach its rows'
    largest visible count, which the caller guarantees (`index_score_rows` checks it).

    q [B, T, H, D], keys B tensors [n_i, D], weights [B, T, H] bf16 on CPU; visible [B, T] integers.
    """
    keys = [k if k.is_contiguous() else k.contiguous() for k in keys]  # alive until the scores are made
    return _scores(q, [k.data_ptr() for k in keys], max(k.size(0) for k in keys), weights, visible)


def _scores(
    q: torch.Tensor, key_at: Sequence[int], n: int, weights: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor | None:
    """The kernel once per batch row i, over n keys from address key_at[i] (the caller keeps them alive)."""
    lib = _library()
    assert lib is not None
    b, t, h, d = q.shape
    q, weights = q.contiguous(), weights.contiguous()
    seen = None
    if visible is not None:
        seen = visible.to(torch.int64).expand(b, t).contiguous()
    out = torch.empty(b, t, n, dtype=torch.bfloat16)
    if n == 0 or t == 0:
        return out
    # batch row i's pointers as `x[i].data_ptr()` gives them (the base plus i strides), without its five
    # dispatched selects a row: a 44-sequence decode step scored 44 rows in each of its index layers
    bases = [x.data_ptr() for x in (q, weights, out)]
    steps = [x.stride(0) * x.element_size() for x in (q, weights, out)]
    seen_at, seen_step = (0, 0) if seen is None else (seen.data_ptr(), seen.stride(0) * seen.element_size())
    for i, ki in enumerate(key_at):
        qi, wi, oi = (base + i * step for base, step in zip(bases, steps, strict=True))
        failed = lib.index_score_bf16(
            qi, ki, wi, t, h, d, n, None if seen is None else seen_at + i * seen_step, oi
        )
        if failed:
            return None
    return out
