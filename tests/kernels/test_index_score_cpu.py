"""The compiled CPU indexer scores (kernels/index_score/cpu.py) against their slow twin, the torch
reference: every score's bits, on fresh random inputs of the shapes the models use and the edges of the
C code's order (head dims, short key blocks, one query row, masks, zeros, tiny products)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import index_score, qdq_mxfp4
from kernels.index_score import cpu
from kernels.index_score.reference import index_score_reference

pytestmark = pytest.mark.skipif(not cpu.usable(torch.zeros(1, 2, 1, 32), torch.zeros(1, 1, 32)),
                                reason="no C compiler / no AVX2+FMA: the reference serves alone")  # fmt: skip


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def _inputs(g: torch.Generator, b: int, t: int, h: int, d: int, n: int, *, scale: float = 1.0):
    q = (torch.randn(b, t, h, d, generator=g) * scale).bfloat16()
    k = (torch.randn(b, n, d, generator=g) * 3 * scale).bfloat16()
    w = torch.randn(b, t, h, generator=g).bfloat16()
    return q, k, w


@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_compiled_scores_equal_the_reference_bit_for_bit(d: int) -> None:
    seed = random.SystemRandom().randrange(2**31)  # fresh inputs every run; the seed is in the message
    g = torch.Generator().manual_seed(seed)
    # (a decode row's few products take the C file's direct loop at D >= 64, the others its blocks of 8 keys)
    for b, t, h, n in [(1, 80, 4, 2053), (2, 3, 4, 517), (1, 1, 4, 9), (1, 5, 1, 300), (3, 2, 2, 1),
                       (5, 1, 2, 701), (2, 2, 1, 333), (1, 1, 3, 64)]:  # fmt: skip
        q, k, w = _inputs(g, b, t, h, d, n)
        visible = torch.randint(0, n + 1, (b, t), generator=g)
        for vis in (None, visible, visible[0]):
            want = index_score_reference(q, k, w, visible=vis)
            got = cpu.index_score_cpu(q, k, w, vis)
            assert got is not None
            assert torch.equal(_bits(got), _bits(want)), (seed, d, b, t, h, n, vis is None)


def _wide(g: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values with random signs over 2^-6..2^6: a sum's order shows in its last bit far more often
    than with normal values (and survives the bf16 rounding of each head's score)."""
    exponent = torch.randint(-6, 7, shape, generator=g).float()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return (sign * torch.exp2(exponent) * (1 + torch.rand(shape, generator=g))).bfloat16()


@pytest.mark.parametrize("d", [16, 32, 64])
def test_wide_range_scores_show_the_order_and_equal_the_reference(d: int) -> None:
    """Wide-range inputs on the blocked loop's shapes (whole and short key blocks, rows that see part of
    a block, a decode row's one row at D = 16 and 32, the direct loop's at 64): every score's bits equal
    the reference's. Normal inputs hide most reorderings of a sum
    after the bf16 rounding; these do not (a swapped lane pair of the D = 32 sums failed here)."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        t, n = int(torch.randint(1, 33, (1,), generator=g)), int(torch.randint(1, 600, (1,), generator=g))
        q, k, w = _wide(g, 1, t, 2, d), _wide(g, 1, n, d), _wide(g, 1, t, 2)
        visible = torch.randint(0, n + 1, (t,), generator=g)
        want = index_score_reference(q, k, w, visible=visible)
        got = cpu.index_score_cpu(q, k, w, visible)
        assert got is not None and torch.equal(_bits(got), _bits(want)), (seed, d, t, n)


def test_views_of_larger_tensors_score_each_batch_row_as_its_own() -> None:
    """Each batch row's pointers are the tensors' base plus i strides (no per-row select): inputs that are
    views with a storage offset, or strided and copied by `.contiguous()`, give every row the reference's
    bits."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    q, k, w = _inputs(g, 9, 2, 2, 32, 301)
    visible = torch.randint(0, 302, (9, 2), generator=g)
    for sl in (slice(1, 6), slice(0, 9, 2), slice(8, 9)):  # an offset, a stride, the last row alone
        qv, kv, wv, vv = q[sl], k[sl], w[sl], visible[sl]
        want = index_score_reference(qv, kv, wv, visible=vv)
        got = cpu.index_score_cpu(qv, kv, wv, vv)
        assert got is not None and torch.equal(_bits(got), _bits(want)), (seed, sl)


def test_quantized_inputs_zeros_and_tiny_products_keep_every_bit() -> None:
    """What the model feeds (MXFP4-QDQ'd queries and keys on a coarse grid, so exact ties and zero
    scores), negative weights (relu's zeros times w < 0 give -0), and products whose fp32 rounding is
    visible (subnormal): these tell a fused multiply-add from a plain one."""
    g = torch.Generator().manual_seed(7)
    q, k, w = _inputs(g, 1, 16, 4, 32, 4096)
    q, k = qdq_mxfp4(q), qdq_mxfp4(k)
    want = index_score_reference(q, k, w)
    assert torch.equal(_bits(cpu.index_score_cpu(q, k, w, None)), _bits(want))
    assert (want == 0).any()
    q, k, w = _inputs(g, 1, 8, 4, 32, 2048, scale=2.0**-70)
    assert torch.equal(_bits(cpu.index_score_cpu(q, k, w, None)), _bits(index_score_reference(q, k, w)))


def test_index_score_takes_the_compiled_path_only_where_it_is_covered() -> None:
    """`index_score` (torch backend) equals the reference on covered and uncovered shapes alike: a head
    dim whose ATen order the C code does not reproduce (8, 24, 40, 96) or a single product row keeps the
    reference."""
    assert cpu.covers(32, 80) and cpu.covers(128, 2) and cpu.covers(16, 2)
    assert not any(cpu.covers(d, 80) for d in (8, 24, 40, 96)) and not cpu.covers(32, 1)
    g = torch.Generator().manual_seed(3)
    for d, t, h in [(32, 7, 4), (8, 7, 4), (24, 7, 4), (40, 7, 4), (96, 3, 2), (32, 1, 1)]:
        q, k, w = _inputs(g, 1, t, h, d, 777)
        visible = torch.randint(0, 778, (t,), generator=g)
        want = index_score_reference(q, k, w, visible=visible)
        assert torch.equal(_bits(index_score(q, k, w, visible=visible)), _bits(want)), (d, t, h)


def test_scores_of_unequal_key_rows_equal_the_padded_call() -> None:
    """`index_score_rows` (a batched decode's keys, each sequence's read where they lie) against
    `index_score` of the same keys padded to the longest: every bit, at visible counts below and at each
    sequence's own length; a count past its keys is refused."""
    from torch.nn.utils.rnn import pad_sequence

    from kernels import index_score, index_score_rows

    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    for d, lengths in [(32, [5, 300, 17, 1, 64]), (16, [40, 41]), (64, [9, 200, 3])]:
        b = len(lengths)
        q = torch.randn(b, 1, 2, d, generator=g).bfloat16()
        w = torch.randn(b, 1, 2, generator=g).bfloat16()
        # each sequence's keys a view into a longer buffer, as a state's append buffer hands them out
        keys = [torch.randn(n + 7, d, generator=g).bfloat16()[:n] for n in lengths]
        for visible in ([[n] for n in lengths], [[max(0, n - 3)] for n in lengths]):
            vis = torch.tensor(visible)
            want = index_score(q, pad_sequence(keys, batch_first=True), w, visible=vis)
            got = index_score_rows(q, keys, w, vis)
            assert _bits(got).equal(_bits(want)), f"seed {seed}, D={d}, lengths {lengths}, visible {visible}"
    with pytest.raises(ValueError, match="visible count 6 of sequence 1 is past its 5 keys"):
        index_score_rows(q[:2], [keys[0], keys[0][:5]], w[:2], torch.tensor([[3], [6]]))
