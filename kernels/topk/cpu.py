"""The compiled CPU path of `select_topk` under the deterministic rule (cpu_select.c): bf16 scores of rows
of at most 2^16 entries, id for id what the torch path of selection.py gives (its slow twin; the tests
compare them on fresh random scores with ties, signed zeros, infinities and NaN).

Integer work only (keys compared, never scores computed), so it is exact on every CPU. Knows nothing of
validation: `select_topk` checks the arguments and decides when this path applies.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native import load_functions

__all__ = ["covers", "select_topk_cpu", "usable"]

_SOURCE = Path(__file__).with_name("cpu_select.c")
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# rows of more entries than this have no 16-bit id field in the key (selection.rank_keys)
_MAX_ENTRIES = 2**16


@cache
def _library() -> ctypes.CDLL | None:
    return load_functions(_SOURCE, {"select_topk_bf16": ([_P, _I64, _I64, _I64, _P, _INT, _INT, _P], _INT)})


def covers(scores: torch.Tensor) -> bool:
    """Whether the compiled path takes these scores: bf16 on the CPU, at most 2^16 entries a row."""
    return scores.dtype == torch.bfloat16 and scores.device.type == "cpu" and scores.size(-1) <= _MAX_ENTRIES


def usable() -> bool:
    """Whether the library builds here (without a C compiler, callers keep the torch path)."""
    return _library() is not None


def select_topk_cpu(
    scores: torch.Tensor, k: int, counts: int | torch.Tensor, drop_neg_inf: bool, *, drop_nan: bool = False
) -> torch.Tensor | None:
    """`select_topk(scores, k, counts, tie_break="deterministic", drop_neg_inf=...)` for scores [B, T, N]
    that `covers` takes and counts as `as_row_counts` shapes them (an int, or [1|B, T, 1] int64): [B, T, k]
    int32, or None when the C code could not allocate its scratch memory (the caller runs torch).
    drop_nan: NaN picks are unusable too (the candidate pool's rule: a block scoring -inf or NaN is not
    above -inf)."""
    lib = _library()
    assert lib is not None
    b, t, n = scores.shape
    out = torch.empty(b, t, k, dtype=torch.int32)
    if k == 0 or b * t == 0:
        return out
    rows = scores.contiguous().view(torch.int16)
    if isinstance(counts, int):
        per_row = torch.full((b * t,), counts, dtype=torch.int64)
    else:
        per_row = counts.expand(b, t, 1).reshape(b * t).contiguous()
    failed = lib.select_topk_bf16(
        rows.data_ptr(), b * t, n, k, per_row.data_ptr(), int(drop_neg_inf), int(drop_nan), out.data_ptr()
    )
    return None if failed else out
