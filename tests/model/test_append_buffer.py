"""The decode hot path's two copy-free steps against their slow twins: `append_rows` (growing a source's
rows into spare capacity) and `gather_selected` (attending over only the selected global rows)."""

from __future__ import annotations

import pytest
import torch

from kernels import copy_blocks, copy_blocks_available, sparse_attn
from model.append_buffer import append_rows, append_rows_many, append_rows_ragged, append_rows_reference
from model.attention import gather_selected


def _rows(g: torch.Generator, n: int, d: int = 8) -> torch.Tensor:
    return torch.randn(1, n, d, generator=g).bfloat16()


def test_append_rows_equals_cat_over_many_appends():
    g = torch.Generator().manual_seed(1)
    fast = ref = _rows(g, 3)
    for _ in range(300):
        new = _rows(g, int(torch.randint(0, 40, (1,), generator=g)))
        fast, ref = append_rows(fast, new), append_rows_reference(ref, new)
        assert fast.shape == ref.shape and torch.equal(fast, ref)


def test_earlier_views_never_change():
    g = torch.Generator().manual_seed(2)
    t = append_rows(_rows(g, 4), _rows(g, 1))
    views = []
    for _ in range(50):
        views.append((t, t.clone()))
        t = append_rows(t, _rows(g, 1))
    assert all(torch.equal(view, copy) for view, copy in views)


def test_two_continuations_of_one_view_do_not_share_rows():
    """A snapshot shares the tip view; the second appender must copy, not overwrite the first's rows."""
    g = torch.Generator().manual_seed(3)
    base = append_rows(_rows(g, 5), _rows(g, 1))
    a_new, b_new = _rows(g, 2), _rows(g, 2)
    a = append_rows(base, a_new)
    b = append_rows(base, b_new)
    assert torch.equal(a, append_rows_reference(base, a_new))
    assert torch.equal(b, append_rows_reference(base, b_new))
    assert a.data_ptr() != b.data_ptr()
    # and each continues on its own
    a2, b2 = append_rows(a, b_new), append_rows(b, a_new)
    assert torch.equal(a2[:, -2:], b_new) and torch.equal(b2[:, -2:], a_new)
    assert torch.equal(a2[:, :-2], a) and torch.equal(b2[:, :-2], b)


def test_grad_batch_and_mode_fall_back_to_a_copy():
    g = torch.Generator().manual_seed(4)
    leaf = torch.randn(1, 3, 4, generator=g, requires_grad=True)
    out = append_rows(leaf, torch.randn(1, 2, 4, generator=g))
    assert out.requires_grad and torch.equal(out.detach()[:, :3], leaf.detach())
    wide = torch.randn(2, 3, 4, generator=g)
    assert torch.equal(append_rows(wide, wide), torch.cat([wide, wide], 1))
    with torch.inference_mode():
        tip = append_rows(_rows(g, 2), _rows(g, 1))
    new = _rows(g, 1)
    assert torch.equal(append_rows(tip, new), append_rows_reference(tip, new))  # copied, no error


def _ids(g: torch.Generator, b: int, t: int, k: int, offset: int, n: int) -> torch.Tensor:
    ids = torch.randint(0, n, (b, t, k), generator=g) + offset
    none = torch.rand(b, t, k, generator=g) < 0.25
    return torch.where(none, -1, ids).int()


def test_gather_selected_attention_is_bitwise_the_full_source():
    g = torch.Generator().manual_seed(5)
    for trial in range(40):
        b, t, k, h, d = 1 + trial % 2, 1 + trial % 3, 16, 2, 32
        w, n = 7, int(torch.randint(20, 300, (1,), generator=g))
        window = torch.randn(b, w, d, generator=g).bfloat16()
        source = torch.randn(b, n, d, generator=g).bfloat16()
        q = torch.randn(b, t, h, d, generator=g).bfloat16()
        sink = torch.randn(h, generator=g)
        comp = _ids(g, b, t, k, w, n)
        window_ids = torch.randint(-1, w, (b, t, 5), generator=g).int()
        full = sparse_attn(q, torch.cat([window, source], 1), sink, torch.cat([window_ids, comp], -1), 0.2)
        picked, ids = gather_selected(source, comp, w, n)
        fast = sparse_attn(q, torch.cat([window, picked], 1), sink, torch.cat([window_ids, ids], -1), 0.2)
        assert torch.equal(fast, full), trial
        if t * k < n:
            assert picked.size(1) == t * k


def _world(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """G histories of one random layout (the same seed gives the same layout): tips of their own
    buffers, one tip held twice (two continuations of one snapshot), one tip's earlier view (not a tip),
    a plain tensor and a tip near its capacity."""
    g = torch.Generator().manual_seed(seed)

    def rows(n: int) -> torch.Tensor:
        return (torch.randn(1, n, 3, 4, generator=g) * 8).to(dtype)

    olds = []
    for _ in range(int(torch.randint(3, 9, (1,), generator=g))):
        t = append_rows(rows(int(torch.randint(1, 30, (1,), generator=g))), rows(1))
        olds.append(t)
    shared = append_rows(rows(4), rows(2))
    earlier = append_rows(rows(3), rows(1))
    later = append_rows(earlier, rows(1))
    full = rows(5)
    for _ in range(int(torch.randint(250, 262, (1,), generator=g))):
        full = append_rows(full, rows(1))
    olds += [shared, shared, earlier, later, rows(6), full]
    order = torch.randperm(len(olds), generator=g).tolist()
    return [olds[i] for i in order]


_WRITERS = [
    pytest.param(False, id="foreach"),
    pytest.param(True, id="native",
                 marks=pytest.mark.skipif(not copy_blocks_available(), reason="no C compiler")),  # fmt: skip
]


@pytest.mark.parametrize("native", _WRITERS)
def test_append_rows_many_equals_its_per_sequence_twin(native):
    """Same values as cat, the same appends in place as `append_rows` one sequence after another, and no
    earlier view changed, over many rounds (buffers fill and regrow), for each stored dtype, with the
    in-place rows written by address (native) and through views (foreach, the slow twin)."""
    seed = int(torch.randint(0, 1 << 30, (1,)))
    for dtype in (torch.bfloat16, torch.uint8, torch.int64, torch.float8_e4m3fn, torch.float32):
        for mode in (False, True):
            with torch.inference_mode(mode):
                lone, many = _world(seed, dtype), _world(seed, dtype)
                g = torch.Generator().manual_seed(seed + 1)
                for step in range(40):
                    k = int(torch.randint(0, 3, (1,), generator=g)) if step % 7 == 3 else 1
                    new = (torch.randn(len(lone), k, 3, 4, generator=g) * 8).to(dtype)
                    before = [t.clone() for t in many]
                    want = [append_rows(t, new[i : i + 1]) for i, t in enumerate(lone)]
                    if step % 5 == 2:
                        new = new.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
                    got = append_rows_many(many, new, native=native)
                    for i, (a, b, old) in enumerate(zip(want, got, many, strict=True)):
                        ref = append_rows_reference(old, new[i : i + 1])
                        assert b.dtype == dtype and b.shape == ref.shape, (seed, step, i)
                        assert torch.equal(b.view(torch.uint8), ref.view(torch.uint8)), (seed, step, i)
                        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (seed, step, i)
                        in_place_a = a.data_ptr() == lone[i].data_ptr()
                        assert in_place_a == (b.data_ptr() == old.data_ptr()), (seed, step, i)
                    assert all(torch.equal(t.view(torch.uint8), c.view(torch.uint8))
                               for t, c in zip(many, before, strict=True))  # fmt: skip
                    lone, many = want, got


@pytest.mark.parametrize("native", _WRITERS)
def test_append_rows_ragged_equals_its_per_sequence_twin(native):
    """Runs of unequal lengths (0 included) appended in one call: the values of cat, the same appends in
    place as `append_rows` one sequence after another, and no earlier view changed, over many rounds
    (buffers fill and regrow), for each stored dtype, written by address (native) and through views."""
    seed = int(torch.randint(0, 1 << 30, (1,)))
    for dtype in (torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.float32):
        with torch.inference_mode():
            lone, many = _world(seed, dtype), _world(seed, dtype)
            g = torch.Generator().manual_seed(seed + 2)
            for step in range(30):
                counts = torch.randint(0, 9, (len(lone),), generator=g).tolist()
                new = (torch.randn(1, sum(counts), 3, 4, generator=g) * 8).to(dtype)
                starts = [sum(counts[:i]) for i in range(len(counts))]
                before = [t.clone() for t in many]
                runs = zip(lone, starts, counts, strict=True)
                want = [append_rows(t, new[:, a : a + c]) for t, a, c in runs]
                if step % 5 == 2:
                    new = torch.cat([new, new], dim=-1)[..., :4]  # the same rows, not contiguous
                    assert not new.is_contiguous()
                got = append_rows_ragged(many, new, counts, native=native)
                for i, (a, b, old) in enumerate(zip(want, got, many, strict=True)):
                    ref = append_rows_reference(old, new[:, starts[i] : starts[i] + counts[i]])
                    assert b.dtype == dtype and b.shape == ref.shape, (seed, step, i)
                    assert torch.equal(b.view(torch.uint8), ref.view(torch.uint8)), (seed, step, i)
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (seed, step, i)
                    in_place_a = a.data_ptr() == lone[i].data_ptr()
                    assert in_place_a == (b.data_ptr() == old.data_ptr()), (seed, step, i)
                    if counts[i] == 0:
                        assert b is old, (seed, step, i)
                assert all(torch.equal(t.view(torch.uint8), c.view(torch.uint8))
                           for t, c in zip(many, before, strict=True))  # fmt: skip
                lone, many = want, got


@pytest.mark.parametrize("native", _WRITERS)
def test_append_rows_ragged_refuses_what_does_not_add_up(native):
    g = torch.Generator().manual_seed(9)
    base = [append_rows(_rows(g, 4), _rows(g, 1)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"\[1, 5, \.\.\.\] for counts \[2, 3\]"):
        append_rows_ragged(base, torch.zeros(1, 4, 8).bfloat16(), [2, 3], native=native)
    with pytest.raises(ValueError, match=r"count >= 0.*\[2, -1\]"):
        append_rows_ragged(base, torch.zeros(1, 1, 8).bfloat16(), [2, -1], native=native)
    with pytest.raises(ValueError, match="each of the 2"):
        append_rows_ragged(base, torch.zeros(1, 2, 8).bfloat16(), [2], native=native)
    assert append_rows_ragged([], torch.zeros(1, 0, 8), [], native=native) == []


@pytest.mark.parametrize("native", _WRITERS)
def test_append_rows_many_two_continuations_and_refusals(native):
    g = torch.Generator().manual_seed(6)
    base = append_rows(_rows(g, 5), _rows(g, 1))
    new = torch.randn(2, 2, 8, generator=g).bfloat16()
    a, b = append_rows_many([base, base], new, native=native)
    assert torch.equal(a, append_rows_reference(base, new[:1]))
    assert torch.equal(b, append_rows_reference(base, new[1:]))
    assert a.data_ptr() == base.data_ptr() and b.data_ptr() != a.data_ptr()
    leaf = torch.randn(1, 3, 8, generator=g, requires_grad=True)
    plain = torch.randn(1, 3, 8, generator=g)
    rows = torch.randn(2, 1, 8, generator=g)
    out = append_rows_many([leaf, plain], rows, native=native)
    assert out[0].requires_grad and torch.equal(
        out[0].detach(), append_rows_reference(leaf, rows[:1]).detach()
    )
    assert torch.equal(out[1], append_rows_reference(plain, rows[1:]))
    with pytest.raises(ValueError, match="G=2"):
        append_rows_many([base, base], new[:1])
    assert append_rows_many([], new[:0], native=native) == []


@pytest.mark.skipif(not copy_blocks_available(), reason="no C compiler")
def test_copy_blocks_copies_each_block_and_refuses_bad_arguments():
    from array import array

    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (5, 24), generator=g, dtype=torch.uint8)
    dst = torch.zeros(5, 40, dtype=torch.uint8)
    order = torch.randperm(5, generator=g).tolist()
    copy_blocks(array("q", [dst[i].data_ptr() + 3 for i in range(5)]),
                       array("q", [src[j].data_ptr() for j in order]), 24)  # fmt: skip
    assert torch.equal(dst[:, 3:27], src[order]) and not dst[:, :3].any() and not dst[:, 27:].any()
    copy_blocks(array("q"), array("q"), 24)  # nothing to copy
    with pytest.raises(ValueError, match="one length"):
        copy_blocks(array("q", [1]), array("q"), 8)
    with pytest.raises(ValueError, match="array"):
        copy_blocks(array("i", [1]), array("q", [1]), 8)
    with pytest.raises(ValueError, match="nbytes=-1"):
        copy_blocks(array("q"), array("q"), -1)
