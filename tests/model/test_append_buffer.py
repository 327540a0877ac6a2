"""The decode hot path's two copy-free steps against their slow twins: `append_rows` (growing a source's
rows into spare capacity) and `gather_selected` (attending over only the selected global rows)."""

from __future__ import annotations

import torch

from kernels import sparse_attn
from model.append_buffer import append_rows, append_rows_reference
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
