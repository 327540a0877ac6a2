"""One-row fp32 products of many rows (kernels/fp32_rows) against their slow twin, one `F.linear` per row:
every output's bits on fresh wide-range inputs (where the sums' order shows), at the model's shapes and
odd ones, with rows that are 64-byte aligned and rows that are not; and the cases that keep the twin."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import one_row_products, one_row_products_reference, wide_fp32
from kernels.fp32_rows import cpu

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


@compiled
def test_the_compiled_path_runs_where_it_agrees(monkeypatch) -> None:
    g = torch.Generator().manual_seed(3)
    x, w = wide_fp32(g, 9, 96), wide_fp32(g, 2, 96)
    calls = []
    real = cpu.rows_linear

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(cpu, "rows_linear", counted)
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
