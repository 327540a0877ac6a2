"""The compiled Sinkhorn normalization (kernels/mhc/cpu.py) against its slow twin, the torch
reference: every value's bits on fresh random combs of the shapes the model passes (one row, a decode
batch, a prefill stack, leading dims), other lane counts and round counts, views that are not contiguous,
and the edges (values that underflow to zero, huge spreads)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import sinkhorn, sinkhorn_reference
from kernels.mhc import cpu

pytestmark = pytest.mark.skipif(not cpu.usable(), reason="no C compiler: the reference serves alone")


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
