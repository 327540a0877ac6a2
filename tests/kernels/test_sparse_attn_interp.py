"""sparse_attn Triton kernel vs the torch reference on CPU under TRITON_INTERPRET=1.

Runs only in a process started with TRITON_INTERPRET=1 (the flag must be set before triton is
imported); `test_triton_interpreter.py` starts one in the default suite.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import sparse_attn
from tests.kernels.test_sparse_attn import assert_close, make_inputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs a process started with TRITON_INTERPRET=1"
)

# (B, T, H, D, N, K): several softmax blocks, all -1 rows, T = 1 and 63, H 4..8, D 128.
SHAPES = {
    "decode-T1-H4-K32": (1, 1, 4, 128, 40, 32),
    "T63-H8-K130": (1, 63, 8, 128, 160, 130),
    "B2-T5-H6-D64-K64": (2, 5, 6, 64, 70, 64),
}


# rows without entries compute exp(sink + 1e30) = inf on purpose (the denominator then zeroes them);
# the interpreter's numpy warns about that overflow
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_sparse_attn_triton_matches_torch_interpreted(shape: tuple[int, ...]) -> None:
    from kernels.sparse_attn.triton import sparse_attn_triton

    q, kv, sink, idx = make_inputs(*shape, seed=11)
    scale = q.size(-1) ** -0.5
    want = sparse_attn(q, kv, sink, idx, scale)
    out = torch.full(q.shape, torch.nan, dtype=torch.bfloat16)
    got = sparse_attn_triton(q, kv, sink, idx, scale, out=out)
    assert not got.isnan().any()
    assert torch.equal(got[0, shape[1] // 2], torch.zeros_like(got[0, 0]))
    # exp and summation order may differ from torch's: a tolerance, not bitwise
    one_ulp = 2.0**-7 * want.abs().max().item()
    assert_close("triton(interpreted) vs torch", got, want, rel_l2=1e-3, max_abs=one_ulp)
    assert torch.equal(sparse_attn(q, kv, sink, idx, scale, backend="triton"), got)
