"""index_score Triton kernel vs the torch reference on CPU under TRITON_INTERPRET=1.

Runs only in a process started with TRITON_INTERPRET=1 (the flag must be set before triton is
imported); `test_triton_interpreter.py` starts one in the default suite.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import index_score
from tests.kernels.test_index_score import make_inputs, score_tolerance, topk_sets_agree_without_near_ties

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs a process started with TRITON_INTERPRET=1"
)

# (B, T, H, D, N): v41-tiny prefill and decode, two batches with more heads, released head dim.
SHAPES = {
    "tiny-T37-N37": (1, 37, 4, 64, 37),
    "decode-T1-N301": (1, 1, 4, 64, 301),
    "B2-T20-H8-N150": (2, 20, 8, 64, 150),
    "H32-D128-T17-N70": (1, 17, 32, 128, 70),
}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_index_score_triton_matches_torch_interpreted(shape: tuple[int, ...]) -> None:
    from kernels.index_score.triton import index_score_triton

    b, t, h, d, n = shape
    q, k, w = make_inputs(*shape, seed=12)
    g = torch.Generator().manual_seed(13)
    visible = torch.randint(0, n + 1, (b, t), generator=g, dtype=torch.int32)
    candidates = torch.rand(b, t, n, generator=g) > 0.25
    want = index_score(q, k, w, visible=visible, candidates=candidates)
    out = torch.full((b, t, n), torch.nan, dtype=torch.bfloat16)
    got = index_score_triton(q, k, w, visible=visible, candidates=candidates, out=out)
    assert not got.isnan().any()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    excess = ((got.float() - want.float()).abs() - score_tolerance(q, k, w))[fin]
    assert excess.max().item() <= 0, f"max excess over tolerance {excess.max().item():.3e}"

    plain = index_score(q, k, w, visible=visible[0], backend="triton")
    want_plain = index_score(q, k, w, visible=visible[0])
    margin = (plain.float() - want_plain.float()).nan_to_num(0.0, posinf=0.0, neginf=0.0).abs().max().item()
    kk = min(16, n - 1)
    checked = topk_sets_agree_without_near_ties(plain, want_plain, kk, margin)
    assert checked > 0 or b * t < 16
