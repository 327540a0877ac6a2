"""The compiled deterministic top-k selection (kernels/topk/cpu.py) against its slow twin, the torch ops of
`select_topk(compiled=False)`: the same ids in the same places on fresh random scores full of ties, signed
zeros, infinities and NaN, every visible-count form, both -inf rules, the min-heap (few picks) and the
quickselect (many picks) of the C file, and rows of the largest width the keys allow."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.topk import candidate_ids, cpu, select_topk

pytestmark = pytest.mark.skipif(not cpu.usable(), reason="no C compiler: the torch path alone")


def _scores(g: torch.Generator, b: int, t: int, n: int) -> torch.Tensor:
    """bf16 scores on a coarse grid (many ties), with -inf, NaN, -0.0 and +inf sprinkled in."""
    s = (torch.randn(b, t, n, generator=g) * 3).round().bfloat16()
    u = torch.rand(b, t, n, generator=g)
    s[u < 0.1] = -torch.inf
    s[(u >= 0.1) & (u < 0.12)] = float("nan")
    s[(u >= 0.12) & (u < 0.15)] = -0.0
    s[(u >= 0.15) & (u < 0.16)] = torch.inf
    return s


def _both(scores: torch.Tensor, k: int, visible, drop: bool) -> tuple[torch.Tensor, torch.Tensor]:
    kw = {"tie_break": "deterministic", "drop_neg_inf": drop}
    fast = select_topk(scores, k, visible, compiled=True, **kw)
    return fast, select_topk(scores, k, visible, compiled=False, **kw)


def test_compiled_selection_equals_the_torch_ops_on_fresh_scores() -> None:
    seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; the seed is in the message
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for trial in range(200):
        b, t, n = rng.randint(1, 4), rng.randint(1, 8), rng.randint(1, 900)
        # few picks against many entries (the heap), and any number (mostly the quickselect)
        k = rng.randint(0, max(0, n // 8)) if trial % 2 else rng.randint(0, n)
        scores = _scores(g, b, t, n)
        visible = rng.choice([
            rng.randint(0, n + 2),
            torch.randint(0, n + 3, (t,), generator=g),
            torch.randint(0, n + 3, (b, t), generator=g),
        ])  # fmt: skip
        for drop in (True, False):
            got, want = _both(scores, k, visible, drop)
            assert got.dtype == want.dtype == torch.int32, (seed, trial)
            assert torch.equal(got, want), (seed, trial, b, t, n, k, drop)


def test_few_picks_whose_last_falls_among_signed_zeros() -> None:
    """The min-heap's rows (k at most n / 8, scanned 8 entries at a time) where the k-th pick lies in a
    run of +0 and -0: they tie, so ids decide, whatever the sign; fewer positives than k, a sprinkle of
    NaN, +inf and -inf, and every row width mod 8 (the scan's tail)."""
    seed = random.SystemRandom().randrange(2**31)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for trial in range(60):
        t, n = rng.randint(1, 6), rng.randint(16, 700)
        k = rng.randint(1, n // 8)
        u = torch.rand(1, t, n, generator=g)
        scores = torch.where(u < 0.5, torch.tensor(0.0), torch.tensor(-0.0)).bfloat16()
        scores[u > 0.9] = -1.0
        scores[u > 0.97] = -torch.inf
        picks = torch.rand(1, t, n, generator=g)
        scores[picks < (k / 2) / n] = 2.0  # about k / 2 positives a row
        scores[picks > 1 - 0.5 / n] = float("nan")
        scores[(picks > 0.3) & (picks < 0.3 + 0.5 / n)] = torch.inf
        for drop in (True, False):
            got, want = _both(scores, k, rng.randint(0, n + 2), drop)
            assert torch.equal(got, want), (seed, trial, t, n, k, drop)


def test_rows_of_the_widest_key_and_strided_scores() -> None:
    """2^16 entries (the id field's whole range), a non-contiguous view, and all-equal rows (the order
    is then the ids alone)."""
    g = torch.Generator().manual_seed(7)
    wide = _scores(g, 1, 2, 2**16)
    for k in (1, 64, 4096):
        got, want = _both(wide, k, 2**16, True)
        assert torch.equal(got, want), k
    strided = _scores(g, 3, 5, 400).transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    got, want = _both(strided, 40, 350, True)
    assert torch.equal(got, want)
    flat = torch.zeros(2, 3, 50, dtype=torch.bfloat16)
    got, want = _both(flat, 7, 50, False)
    assert torch.equal(got, want) and got[0, 0].tolist() == list(range(7))


def test_where_the_compiled_path_does_not_apply_the_torch_ops_answer() -> None:
    g = torch.Generator().manual_seed(3)
    fp32 = torch.randn(2, 3, 40, generator=g)
    too_wide = torch.zeros(1, 1, 2**16 + 1, dtype=torch.bfloat16)
    assert not cpu.covers(fp32) and not cpu.covers(too_wide)
    assert torch.equal(
        select_topk(fp32, 5, 40, tie_break="deterministic"),
        select_topk(fp32, 5, 40, tie_break="deterministic", compiled=False),
    )
    with pytest.raises(ValueError, match="compiled=True"):
        select_topk(fp32, 5, 40, tie_break="deterministic", compiled=True)
    with pytest.raises(ValueError, match="compiled=True"):
        select_topk(fp32.bfloat16(), 5, 40, tie_break="reference", compiled=True)


def test_compiled_candidate_pools_equal_the_torch_ops() -> None:
    """`candidate_ids` picks its blocks with the compiled selection: the same pools as its torch ops on
    fresh scores with ties, NaN (a NaN block is not above -inf, so it is dropped like a -inf one),
    infinities and short last blocks."""
    seed = random.SystemRandom().randrange(2**31)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for trial in range(60):
        b, t, n = rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 700)
        scores = _scores(g, b, t, n)
        if trial % 3 == 0:
            scores[..., rng.randrange(n)] = float("nan")
        visible = rng.choice([rng.randint(0, n), torch.randint(0, n + 1, (b, t), generator=g)])
        for block, blocks in ((4, 3), (7, 2), (16, 8)):
            got = candidate_ids(scores, visible, block, blocks)
            want = candidate_ids(scores, visible, block, blocks, compiled=False)
            assert torch.equal(got, want), (seed, trial, b, t, n, block, blocks)
