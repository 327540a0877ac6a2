"""window_ids(canonical=True), the layout of tie_break="deterministic": the visible keys of the slow twin
(a naive mask), in the same columns whatever the pass, so chunked ced prefill equals one-shot bit for bit."""

from __future__ import annotations

import pytest
import torch

from model import Transformer, init_random, load_preset, prefill
from model.attention import window_ids

W = 32


def _positions(ids: torch.Tensor, start: int, w: int, uses_ring: bool, p: int) -> list[int]:
    """Key positions named by one row of ids (ring slots resolved against the row's position p)."""
    out = []
    for i in ids.tolist():
        if i < 0:
            continue
        if not uses_ring:
            out.append(start + i)
        elif i >= w:
            out.append(start + i - w)
        else:
            out.append(next(q for q in range(p - w + 1, start) if q % w == i))
    return out


@pytest.mark.parametrize(
    ("start", "rows", "floor", "ring_from"),
    [(0, 5, 0, 0), (0, 40, 0, 0), (37, 1, 0, 0), (37, 9, 30, 0), (100, 50, 0, 90), (5, 3, 0, 0),
     (69, 3, 69, 0), (72, 29, 69, 0), (60, 4, 0, 64)],
)
def test_window_ids_canonical_match_naive_mask(start: int, rows: int, floor: int, ring_from: int) -> None:
    eff = max(floor, ring_from)
    ids, uses_ring = window_ids(start, rows, W, eff, torch.device("cpu"), canonical=True)
    assert ids.shape == (rows, W)
    for r in range(rows):
        p = start + r
        # rows of this pass are always visible (a replay recomputes them); the ring from the effective floor
        lowest = max(0, eff) if eff < start else start
        want = list(range(max(p - W + 1, lowest), p + 1))
        got = _positions(ids[r], start, W, uses_ring, p)
        assert got == want, (r, got, want)
        # visible keys first, ascending, then only -1
        assert (ids[r, len(want) :] == -1).all() and (ids[r, : len(want)] >= 0).all()


@torch.inference_mode()
def test_prefill_ced_chunked_across_the_decoder_tail_equals_one_shot() -> None:
    torch.set_num_threads(1)
    model = init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()
    # tokens and cuts where the reference prefill/ring layouts put the same keys in other columns
    toks = torch.randint(0, 512, (1, 101), generator=torch.Generator().manual_seed(1234))
    whole = prefill(model, toks, mode="ced")
    state = None
    for lo, hi in [(0, 38), (38, 72), (72, 101)]:
        out = prefill(model, toks[:, lo:hi], state, mode="ced", prompt_end=101)
        state = out.state
    assert torch.equal(out.logits, whole.logits), (out.logits - whole.logits).abs().max()
