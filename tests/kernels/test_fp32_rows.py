"""One-row fp32 products of many rows (kernels/fp32_rows) against their slow twin, one `F.linear` per row:
every output's bits on fresh wide-range inputs (where the sums' order shows), at the model's shapes and
odd ones, with rows that are 64-byte aligned and rows that are not; and the cases that keep the twin."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv_order_takes, one_row_products, one_row_products_reference, wide_fp32
from kernels.fp32_rows import cpu
from orchestrator.numerics_env import cpu_model_name

compiled = pytest.mark.skipif(not cpu.available(), reason="no C compiler, or torch exports no sgemm_")


@compiled
@pytest.mark.parametrize("k,n", [(96, 2), (96, 8), (17, 3), (384, 24), (1000, 7), (96, 4096)])
def test_one_row_products_equal_one_f_linear_per_row(k: int, n: int) -> None:
    seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; the seed is in the message
    g = torch.Generator().manual_seed(seed)
    w = wide_fp32(g, n, k)
    assert cpu.agrees(k, n, torch.get_num_threads()), (seed, k, n)
    for m in (1, 2, 5, 46, 64):
        x = wide_fp32(g, m, k)
        got = one_row_products(x, w)
        want = torch.cat([F.linear(x[i : i + 1], w) for i in range(m)])
        assert got.shape == (m, n) and torch.equal(got, want), (seed, k, n, m)
        # rows that start off a 64-byte boundary (the compiled path reads them where they lie)
        shifted = wide_fp32(g, m * k + 3)[3:].view(m, k)
        got = one_row_products(shifted, w)
        want = torch.cat([F.linear(shifted[i : i + 1], w) for i in range(m)])
        assert torch.equal(got, want), (seed, k, n, m, "shifted")


def _counted(monkeypatch, name: str) -> list:
    """`cpu.<name>` replaced by a stand-in that notes each call's arguments and calls it; the notes."""
    calls: list = []
    real = getattr(cpu, name)

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(cpu, name, counted)
    return calls


@compiled
def test_the_compiled_path_runs_where_it_agrees(monkeypatch) -> None:
    g = torch.Generator().manual_seed(3)
    x, w = wide_fp32(g, 9, 96), wide_fp32(g, 2, 96)
    assert cpu.agrees(96, 2, torch.get_num_threads())  # the first-use probe (it calls rows_linear) first
    calls = _counted(monkeypatch, "rows_linear")
    with torch.inference_mode():
        assert torch.equal(one_row_products(x, w), one_row_products_reference(x, w))
    assert len(calls) == 1


def test_the_twin_runs_for_what_the_compiled_path_does_not_take() -> None:
    g = torch.Generator().manual_seed(4)
    w = wide_fp32(g, 3, 32)
    strided = wide_fp32(g, 32, 5).t()  # [5, 32], not contiguous
    assert torch.equal(one_row_products(strided, w), one_row_products_reference(strided, w))
    assert one_row_products(wide_fp32(g, 0, 32), w).shape == (0, 3)
    leaf = wide_fp32(g, 4, 32).requires_grad_()
    out = one_row_products(leaf, w)
    out.sum().backward()  # autograd recorded the product: the twin ran
    assert leaf.grad is not None and torch.equal(out.detach(), one_row_products_reference(leaf.detach(), w))


def test_bad_shapes_and_dtypes_name_the_values() -> None:
    w = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"\[M, K\].*\(3, 7\)"):
        one_row_products(torch.zeros(3, 7), w)
    with pytest.raises(ValueError, match="bfloat16"):
        one_row_products(torch.zeros(3, 8, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"\(8,\)"):
        one_row_products(torch.zeros(8), w)


# The model's shapes (v41-sib-s: the head, the mHC mixes, the compressor) and others the order covers.
_GEMV_SHAPES = [(96, 4096), (384, 24), (96, 64), (8, 4), (100, 36), (1024, 8)]


def _skip_unless_gemv_order_takes(k: int, n: int) -> None:
    """Skip what only the C file's matrix-vector order does where MKL sums one-row products in another
    order. The order was read off an AMD EPYC (Zen 4) under the portable profile (MKL_CBWR=AVX2); an Intel
    Xeon with AVX-512 runs the suite under the strict profile (MKL_CBWR=AVX2,STRICT: the portable one is
    not exact there, orchestrator/numerics_env.py), whose order is another (seen in session 36). The
    first-use probe refuses the shape there and `one_row_products` keeps a BLAS call per row, so the
    exactness checks still run on every machine; only the C order's own checks are skipped."""
    if not gemv_order_takes(k, n):
        profile = os.environ.get("MKL_CBWR", "unset")
        pytest.skip(f"MKL's one-row order on {cpu_model_name()} (MKL_CBWR={profile}) is not the C file's")


@compiled
@pytest.mark.parametrize("k,n", _GEMV_SHAPES)
def test_the_gemv_order_gives_every_row_its_one_row_product(k: int, n: int) -> None:
    seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; the seed is in the message
    g = torch.Generator().manual_seed(seed)
    w = wide_fp32(g, n, k)
    xs = [wide_fp32(g, m, k) for m in (1, 2, 3, 5, 46, 64)]  # odd counts: the C file's blocks of two
    wants = [torch.cat([F.linear(x[i : i + 1], w) for i in range(x.size(0))]) for x in xs]
    # the contract, whichever path this CPU takes
    for x, want in zip(xs, wants, strict=True):
        assert torch.equal(one_row_products(x, w), want), (seed, k, n, x.size(0))
    # zeros, infinities and NaNs go through the same IEEE operations
    x = wide_fp32(g, 4, k)
    x[0] = 0.0
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    x[3, :] = -0.0
    want = torch.cat([F.linear(x[i : i + 1], w) for i in range(4)])
    got = one_row_products(x, w)
    assert torch.equal(got.isnan(), want.isnan()), (seed, k, n)
    kept = ~want.isnan()  # every other output bit for bit, the sign of a zero included
    assert torch.equal(got[kept].view(torch.int32), want[kept].view(torch.int32)), (seed, k, n)
    _skip_unless_gemv_order_takes(k, n)
    packed = cpu.pack_gemv_weight(w)
    for x, want in zip(xs, wants, strict=True):
        assert torch.equal(cpu.gemv_order_linear(x, packed, n), want), (seed, k, n, x.size(0))


@compiled
def test_the_gemv_order_path_runs_and_keeps_the_packed_weight_while_it_holds(monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    w, x = wide_fp32(g, 24, 384), wide_fp32(g, 7, 384)
    _skip_unless_gemv_order_takes(384, 24)  # the first-use probe (it packs a weight of its own) first
    packs = _counted(monkeypatch, "pack_gemv_weight")
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(one_row_products(x, w), one_row_products_reference(x, w))
    assert len(packs) == 1
    # the weight changed in place: packed again, and the products follow it
    w.mul_(2)
    assert torch.equal(one_row_products(x, w), one_row_products_reference(x, w))
    assert len(packs) == 2


@compiled
@pytest.mark.parametrize("k,n", [(96, 30), (96, 2), (98, 24)])
def test_shapes_the_gemv_order_does_not_take_keep_another_path(k: int, n: int) -> None:
    # N not a multiple of 4 (MKL sums its last outputs otherwise), N = 2, K not a multiple of 4
    assert not gemv_order_takes(k, n)
    g = torch.Generator().manual_seed(6)
    w, x = wide_fp32(g, n, k), wide_fp32(g, 9, k)
    assert torch.equal(one_row_products(x, w), one_row_products_reference(x, w))
