"""The compiled mHC ops (kernels/mhc/cpu.py) against their slow twins, the torch references: the Sinkhorn
normalization's and the lane mixes' (collapse, expand) every bit on fresh random inputs of the shapes the
model passes (one row, a decode batch, a prefill stack, leading dims), other lane and round counts, views
that are not contiguous, and the edges (underflow to zero, signed zeros, non-finite values, wide ranges
where the sums' order shows)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import mhc_collapse, mhc_expand, sinkhorn, sinkhorn_reference
from kernels.mhc import collapse_reference, cpu, expand_reference

pytestmark = pytest.mark.skipif(
    not (cpu.usable() and cpu.lanes_usable()), reason="no C compiler: the references serve alone"
)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _combs(g: torch.Generator, *shape: int, spread: float = 3.0) -> torch.Tensor:
    raw = torch.randn(*shape, generator=g) * spread
    return torch.exp(raw - raw.amax(dim=-1, keepdim=True))


@pytest.mark.parametrize("hc", [2, 3, 4])
def test_compiled_sinkhorn_equals_the_reference_bit_for_bit(hc: int) -> None:
    seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; the seed is in the message
    g = torch.Generator().manual_seed(seed)
    for shape in [(1, 1), (1, 7), (64, 1), (1, 301), (2, 3, 5)]:
        for spread, iters in [(0.5, 20), (3.0, 20), (12.0, 20), (3.0, 1), (3.0, 2)]:
            comb = _combs(g, *shape, hc, hc, spread=spread)
            got = cpu.sinkhorn_cpu(comb, iters, 1e-6)
            assert got is not None
            assert torch.equal(got, sinkhorn_reference(comb, iters, 1e-6)), (seed, hc, shape, spread, iters)


def test_views_zeros_and_the_dispatch_keep_every_bit() -> None:
    """A non-contiguous view (transposed combs), combs whose entries underflow to +0 after the exp, and
    the public `sinkhorn`, which keeps the reference where autograd records and for iters < 1 runs the
    one round the official loop always runs."""
    g = torch.Generator().manual_seed(4)
    comb = _combs(g, 1, 9, 4, 4).transpose(-1, -2)
    assert not comb.is_contiguous()
    assert torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6))
    zeros = _combs(g, 1, 33, 4, 4, spread=60.0)
    assert (zeros == 0).any()
    assert torch.equal(sinkhorn(zeros, 20, 1e-6), sinkhorn_reference(zeros, 20, 1e-6))
    assert torch.equal(sinkhorn(zeros, 0, 1e-6), sinkhorn_reference(zeros, 1, 1e-6))
    tracked = _combs(g, 1, 3, 4, 4).requires_grad_()
    out = sinkhorn(tracked, 20, 1e-6)
    assert out.grad_fn is not None
    out.sum().backward()
    assert tracked.grad is not None


def test_wider_combs_keep_the_reference() -> None:
    """From 5 lanes on torch's sums take other orders: `sinkhorn` runs the reference there."""
    g = torch.Generator().manual_seed(8)
    assert not cpu.covers(5) and not cpu.covers(8) and cpu.covers(4)
    for hc in (5, 8, 16):
        comb = _combs(g, 1, 64, hc, hc)
        assert torch.equal(sinkhorn(comb, 20, 1e-6), sinkhorn_reference(comb, 20, 1e-6))


def test_sinkhorn_refuses_what_is_not_a_comb() -> None:
    with pytest.raises(ValueError, match="fp32"):
        sinkhorn(torch.ones(3, 4, 4, dtype=torch.bfloat16), 20, 1e-6)
    with pytest.raises(ValueError, match=r"\(3, 4, 5\)"):
        sinkhorn(torch.ones(3, 4, 5), 20, 1e-6)


def _wide(g: torch.Generator, lo: int, hi: int, *shape: int) -> torch.Tensor:
    exponent = torch.randint(lo, hi, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return sign * torch.exp2(exponent) * (1 + torch.rand(shape, generator=g))


def test_the_lanes_probe_refuses_lane_sums_in_another_order(monkeypatch) -> None:
    """A collapse or expand whose lane sums run pairwise must fail the first-use probe (on normal-valued
    lanes alone such sums matched torch's in every output: its cancelling lanes show the order)."""

    def pairwise(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        p = pre.unsqueeze(-1) * x.float()
        return ((p[..., 0, :] + p[..., 2, :]) + (p[..., 1, :] + p[..., 3, :])).to(x.dtype)

    def expand_pairwise(y, residual, post, comb):
        mixed = comb.unsqueeze(-1) * residual.float().unsqueeze(-2)  # [..., i, j, d]
        lanes = (mixed[..., 0, :, :] + mixed[..., 2, :, :]) + (mixed[..., 1, :, :] + mixed[..., 3, :, :])
        return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + lanes).to(y.dtype)

    monkeypatch.setattr(cpu, "collapse_cpu", pairwise)
    assert not cpu._lanes_probe.__wrapped__()
    monkeypatch.undo()
    monkeypatch.setattr(cpu, "expand_cpu", expand_pairwise)
    assert not cpu._lanes_probe.__wrapped__()
    monkeypatch.undo()
    assert cpu._lanes_probe.__wrapped__()


@pytest.mark.parametrize("hc", [1, 2, 4])
def test_compiled_collapse_and_expand_equal_the_reference_bit_for_bit(hc: int) -> None:
    """Wide-range lanes (the sums' order shows: a pairwise or reversed sum differs) and ordinary ones, one
    row to a prefill stack, with leading dims."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    for lead in [(1, 1), (1, 9), (3, 2), (1, 700)]:
        for lo, hi in [(-2, 3), (-9, 9)]:
            res = _wide(g, lo, hi, *lead, hc, 96).bfloat16()
            y = _wide(g, lo - 10, hi - 6, *lead, 96).bfloat16()
            post = _wide(g, -2, 2, *lead, hc)
            comb = _wide(g, -3, 2, *lead, hc, hc).abs()
            got = cpu.expand_cpu(y, res, post, comb)
            assert got is not None
            assert torch.equal(_bits(got), _bits(expand_reference(y, res, post, comb))), (seed, hc, lead)
            got = cpu.collapse_cpu(res, post.abs())
            assert got is not None
            assert torch.equal(_bits(got), _bits(collapse_reference(res, post.abs()))), (seed, hc, lead)


def test_lane_mixes_keep_zeros_signs_non_finite_values_and_the_dispatch() -> None:
    """All -0 products sum to +0 (torch's sum starts from +0); NaN and infinities propagate as torch's;
    views, wider lanes and autograd take the reference, with the same bits or gradients."""
    g = torch.Generator().manual_seed(6)
    res = torch.full((1, 3, 4, 32), -0.0).bfloat16()
    y = torch.full((1, 3, 32), -0.0).bfloat16()
    ones = torch.ones(1, 3, 4)
    comb = torch.ones(1, 3, 4, 4)
    assert torch.equal(_bits(mhc_expand(y, res, ones, comb)), _bits(expand_reference(y, res, ones, comb)))
    assert torch.equal(_bits(mhc_collapse(res, ones)), _bits(collapse_reference(res, ones)))
    res = torch.randn(1, 4, 4, 32, generator=g).bfloat16()
    res[0, 0, 1, 2], res[0, 1, 2, 3], res[0, 2, 0, 4] = float("nan"), float("inf"), float("-inf")
    y = torch.randn(1, 4, 32, generator=g).bfloat16()
    post, comb = torch.rand(1, 4, 4, generator=g), torch.rand(1, 4, 4, 4, generator=g)
    for got, want in [
        (mhc_expand(y, res, post, comb), expand_reference(y, res, post, comb)),
        (mhc_collapse(res, post), collapse_reference(res, post)),
    ]:
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(_bits(got[~want.isnan()]), _bits(want[~want.isnan()]))
    view = torch.randn(1, 32, 4, 5, generator=g).bfloat16().transpose(1, 3)[:, :, :4]  # [1, 5, 4, 32]
    assert not view.is_contiguous()
    post5 = torch.rand(1, 5, 4, generator=g)
    assert torch.equal(_bits(mhc_collapse(view, post5)), _bits(collapse_reference(view, post5)))
    assert not cpu.lanes_cover(5, 96) and cpu.lanes_cover(4, 96)
    wide = torch.randn(1, 3, 6, 16, generator=g).bfloat16()
    pre6 = torch.rand(1, 3, 6, generator=g)
    assert torch.equal(_bits(mhc_collapse(wide, pre6)), _bits(collapse_reference(wide, pre6)))
    tracked = torch.rand(1, 3, 4, generator=g).requires_grad_()
    mhc_collapse(torch.randn(1, 3, 4, 16, generator=g).bfloat16(), tracked).float().sum().backward()
    assert tracked.grad is not None
