"""index_score: the torch reference against a loop twin and its masks; Triton on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels import index_score, index_score_at

# (B, T, H, D, N): tiny config (4 heads x 64), released-style (32 x 128), decode T = 1, odd sizes.
SHAPES = {
    "tiny-T37-N18": (1, 37, 4, 64, 18),
    "decode-T1-N301": (1, 1, 4, 64, 301),
    "B2-T63-H8-N150": (2, 63, 8, 64, 150),
    "H32-D128-T20-N70": (1, 20, 32, 128, 70),
    "T3-N1000": (1, 3, 4, 64, 1000),
}


def make_inputs(b: int, t: int, h: int, d: int, n: int, *, seed: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 q, k and scaled head weights of both signs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g).bfloat16()
    k = torch.randn(b, n, d, generator=g).bfloat16()
    w = (torch.randn(b, t, h, generator=g) * (d**-0.5 * h**-0.5)).bfloat16()
    return q, k, w


def index_score_naive(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Loop twin over (batch, row): fp32 dot rounded to bf16, relu, bf16 product, fp32 head sum to bf16."""
    b, t, h, _ = q.shape
    out = torch.empty(b, t, k.size(1), dtype=torch.bfloat16)
    for bi in range(b):
        for ti in range(t):
            s = (q[bi, ti].float() @ k[bi].float().T).bfloat16().relu()  # [H, N]
            prod = (s.float() * w[bi, ti].float().unsqueeze(-1)).bfloat16()
            out[bi, ti] = prod.float().sum(0).bfloat16()
    return out


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's bf16 spacing (finite entries only)."""
    fin = torch.isfinite(want)
    w = want.float()[fin]
    spacing = torch.ldexp(torch.ones_like(w), torch.frexp(w).exponent - 8).clamp_min(2.0**-133)
    return (got.float()[fin] - w).abs() / spacing


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_index_score_torch_matches_loop_twin(shape: tuple[int, ...]) -> None:
    q, k, w = make_inputs(*shape, seed=1)
    got = index_score(q, k, w)
    assert got.dtype == torch.bfloat16 and got.shape == (shape[0], shape[1], shape[4])
    want = index_score_naive(q, k, w)
    ulps = bf16_ulps(got, want)
    # same rounding points; only fp32 summation order may differ, by one bf16 ulp at most
    assert ulps.max().item() <= 1, f"max {ulps.max().item()} ulp"
    assert (ulps == 0).float().mean().item() > 0.99


def test_index_score_masks_invisible_and_non_candidates() -> None:
    b, t, h, d, n = 2, 9, 4, 64, 5
    q, k, w = make_inputs(b, t, h, d, n, seed=2)
    ratio = 2
    visible = torch.arange(1, t + 1) // ratio  # causal rule for ratio 2: [0, 1, 1, 2, 2, 3, 3, 4, 4]
    plain = index_score(q, k, w)
    masked = index_score(q, k, w, visible=visible)
    invisible = torch.arange(n) >= visible.unsqueeze(-1)  # [T, N]
    assert torch.isneginf(masked[:, invisible]).all()
    assert torch.equal(masked[:, ~invisible], plain[:, ~invisible])
    per_batch = index_score(q, k, w, visible=visible.expand(b, t).contiguous())
    assert torch.equal(per_batch, masked)
    cand = torch.rand(b, t, n, generator=torch.Generator().manual_seed(3)) > 0.5
    both = index_score(q, k, w, visible=visible, candidates=cand)
    assert torch.equal(torch.isneginf(both), invisible.expand(b, t, n) | ~cand)
    assert torch.equal(both[~torch.isneginf(both)], plain[~torch.isneginf(both)])


def test_index_score_rejects_bad_inputs() -> None:
    q, k, w = make_inputs(1, 3, 4, 64, 7, seed=4)
    with pytest.raises(ValueError, match="backend"):
        index_score(q, k, w, backend="numpy")
    with pytest.raises(ValueError, match="weights must be"):
        index_score(q, k, w[:, :, :2])
    with pytest.raises(ValueError, match="bf16"):
        index_score(q.float(), k, w)
    with pytest.raises(ValueError, match="visible"):
        index_score(q, k, w, visible=torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="candidates"):
        index_score(q, k, w, candidates=torch.ones(1, 3, 6, dtype=torch.bool))


def topk_sets_agree_without_near_ties(got: torch.Tensor, want: torch.Tensor, k: int, margin: float) -> int:
    """Top-k id sets must be equal on rows whose k-th/(k+1)-th gap in `want` exceeds `margin`.

    Returns the number of rows checked, so that a test can insist it checked something.
    """
    top = want.float().sort(dim=-1, descending=True).values
    clear = (top[..., k - 1] - top[..., k]) > margin
    ids_got = got.float().topk(k, dim=-1).indices.sort(-1).values
    ids_want = want.float().topk(k, dim=-1).indices.sort(-1).values
    assert torch.equal(ids_got[clear], ids_want[clear])
    return int(clear.sum())


def score_tolerance(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-score bound [B, T, N] fp32 for a kernel that sums in another fp32 order.

    Each head term may round the other way twice (the q·k and the w product: one bf16 ulp, at most
    2^-7 of the value, each), and the head sum once more.
    """
    terms = torch.einsum("bthd,bnd->bthn", q.float(), k.float()).relu() * w.float().abs().unsqueeze(-1)
    return terms.sum(2) * 2.0**-6 + index_score(q, k, w).float().abs() * 2.0**-7


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [*SHAPES.values(), (1, 300, 32, 128, 4096), (2, 1, 32, 128, 8191)],
    ids=[*SHAPES.keys(), "released-T300-N4096", "decode-B2-N8191"],
)
def test_index_score_triton_matches_torch_on_cuda(shape: tuple[int, ...]) -> None:
    from kernels.index_score.triton import index_score_triton

    b, t, h, d, n = shape
    q, k, w = make_inputs(*shape, seed=5)
    visible = torch.randint(0, n + 1, (b, t), generator=torch.Generator().manual_seed(6), dtype=torch.int32)
    want = index_score(q, k, w, visible=visible)
    out = torch.full((b, t, n), torch.nan, dtype=torch.bfloat16, device="cuda")
    got = index_score_triton(q.cuda(), k.cuda(), w.cuda(), visible=visible.cuda(), out=out).cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    fin = torch.isfinite(want)
    excess = ((got.float() - want.float()).abs() - score_tolerance(q, k, w))[fin]
    assert excess.max().item() <= 0, f"max excess over tolerance {excess.max().item():.3e}"

    plain = index_score(q.cuda(), k.cuda(), w.cuda(), backend="triton").cpu()
    want_plain = index_score(q, k, w)
    margin = (plain.float() - want_plain.float()).abs().max().item()
    checked = topk_sets_agree_without_near_ties(plain, want_plain, min(16, n - 1), margin)
    # with a handful of rows all may be near-tied; with many, most must be clear
    assert checked > 0 or b * t < 16


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_index_score_at_equals_full_scan_at_the_ids(shape: tuple[int, ...]) -> None:
    b, t, _, _, n = shape
    q, k, w = make_inputs(*shape, seed=5)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(-1, n, (b, t, 33), generator=g)
    visible = torch.randint(1, n + 1, (t,), generator=g)
    got = index_score_at(q, k, w, ids, visible=visible)
    full = index_score(q, k, w, visible=visible)
    want = full.gather(-1, ids.clamp_min(0)).masked_fill(ids < 0, -torch.inf)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{(got != want).sum().item()} differ"


def test_index_score_at_rejects_bad_ids() -> None:
    q, k, w = make_inputs(1, 2, 4, 64, 10, seed=0)
    with pytest.raises(ValueError, match="ids must be"):
        index_score_at(q, k, w, torch.zeros(1, 2, 3, dtype=torch.int32))
