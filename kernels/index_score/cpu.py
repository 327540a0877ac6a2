"""The compiled CPU path of the indexer scores (cpu_index_score.c): the full scan of `index_score`
bit for bit equal to the torch reference (reference.py, its slow twin) under the portable numerics
profile, NaN payloads aside, about 10x faster at long histories (benchmarks/bench_attention.py).

Knows nothing of validation (the package's `index_score` does it): it takes CPU bf16 tensors of the
reference's shapes. The C file is built on first use by `kernels.native.load_functions`; without a compiler
`usable()` is False and callers keep the reference.
"""

from __future__ import annotations

import ctypes
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
    lib = _library()
    assert lib is not None
    b, t, h, d = q.shape
    n = k.size(1)
    q, k, weights = q.contiguous(), k.contiguous(), weights.contiguous()
    seen = None
    if visible is not None:
        seen = visible.to(torch.int64).expand(b, t).contiguous()
    out = torch.empty(b, t, n, dtype=torch.bfloat16)
    if n == 0 or t == 0:
        return out
    for i in range(b):
        failed = lib.index_score_bf16(
            q[i].data_ptr(), k[i].data_ptr(), weights[i].data_ptr(), t, h, d, n,
            None if seen is None else seen[i].data_ptr(), out[i].data_ptr(),
        )  # fmt: skip
        if failed:
            return None
    return out
