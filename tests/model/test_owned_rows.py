"""Rows written in place into the rings a state alone holds (model/owned_rows.py): `write_rows` against its
slow twin, the ownership rule (made by a batched pass for one state, given up by `clone`), and
`decode_many` writing in place against `decode_many(in_place=False)` (fresh tensors every step) over steps
that keep snapshots and continue both the snapshots and the states they were taken of."""

from __future__ import annotations

import random

import pytest
import torch

from model import Transformer, decode_many, init_random, load_preset, prefill, prefill_many
from model.owned_rows import mark_owned, owns, write_ring_rows, write_rows


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return init_random(Transformer(load_preset("v41-tiny")), seed=int(torch.randint(0, 10_000, ()))).eval()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _rings(state) -> list[torch.Tensor]:
    """The tensors a batched decode step may write in place: window rings and their stored form, the
    encoder-output rings, the open-group carries."""
    out = list(state.windows) + list(state.window_codes) + list(state.window_scales)
    out += [t for t in (state.enc_lanes, state.enc_pre) if t is not None]
    for layer in sorted(state.sources):
        src = state.sources[layer]
        out += [t for t in (src.carry_kv, src.carry_score) if t is not None]
    return out


def _all_tensors(state) -> list[torch.Tensor]:
    out = [state.tokens, *_rings(state)]
    for layer in sorted(state.sources):
        src = state.sources[layer]
        out += [src.kv, src.index_k, src.kv_packed, src.kv_scales, src.index_packed, src.index_scales]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    pairs = zip(a, b, strict=True)
    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bytes(x), _bytes(y))
               for x, y in pairs)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8])
def test_write_rows_equals_its_twin(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    n, rows_per, shape = 9, 16, (4, 6)

    def fresh() -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(7)
        return [torch.randn(1, rows_per, *shape, generator=g).to(dtype) for _ in range(n)]

    new = torch.randn(n, *shape, generator=gen).to(dtype)
    slots = [int(s) for s in torch.randint(0, rows_per, (n,), generator=gen)]
    native, twin, expected = fresh(), fresh(), fresh()
    write_rows(native, slots, new, native=True)
    write_rows(twin, slots, new, native=False)
    for i, s in enumerate(slots):
        expected[i][0, s] = new[i]
    assert _same(native, expected) and _same(twin, expected)


def test_write_rows_refuses_what_does_not_fit() -> None:
    dsts = [torch.zeros(1, 4, 3) for _ in range(2)]
    with pytest.raises(ValueError, match="one slot and one row"):
        write_rows(dsts, [0], torch.ones(2, 3))
    with pytest.raises(ValueError, match="slots"):
        write_rows(dsts, [0, 4], torch.ones(2, 3))
    with pytest.raises(ValueError, match="do not take rows"):
        write_rows(dsts, [0, 1], torch.ones(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not take rows"):
        write_rows([torch.zeros(1, 3, 4).transpose(1, 2), dsts[1]], [0, 1], torch.ones(2, 3))
    assert all(torch.equal(d, torch.zeros(1, 4, 3)) for d in dsts)
    write_rows([], [], torch.ones(0, 3))  # nothing to write


@torch.inference_mode()
def test_write_ring_rows_writes_what_a_state_owns_and_renews_the_rest() -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    n, slots_per = 7, 5
    owners = [object() for _ in range(n)]
    rings = [[torch.randn(1, slots_per, 3, generator=gen) for _ in range(n)],
             [torch.randn(1, slots_per, generator=gen).bfloat16() for _ in range(n)]]  # fmt: skip
    own = [0, 2, 3, 6]
    for i in own:
        mark_owned(owners[i], (rings[0][i], rings[1][i]))
    mark_owned(owners[5], (rings[0][5],))  # one field only: not written in place
    before = [[t.clone() for t in field] for field in rings]
    new = [torch.randn(n, 3, generator=gen), torch.randn(n, generator=gen).bfloat16()]
    slots = [int(x) for x in torch.randint(0, slots_per, (n,), generator=gen)]
    renewed, fresh = write_ring_rows(rings, new, slots, owners, in_place=True)
    assert renewed == [1, 4, 5]
    after = [list(field) for field in rings]
    for f in range(2):
        for j, i in enumerate(renewed):
            after[f][i] = fresh[f][j]
            assert before[f][i].data_ptr() != fresh[f][j].data_ptr() and owns(owners[i], fresh[f][j])
            assert torch.equal(rings[f][i], before[f][i])  # a tensor not owned is never written
        for i in range(n):
            want = before[f][i].clone()
            want[0, slots[i]] = new[f][i]
            assert torch.equal(after[f][i], want), f"field {f} state {i}"
    # the twin renews every state and marks nothing
    renewed, fresh = write_ring_rows(rings, new, slots, owners, in_place=False)
    assert renewed == list(range(n))
    assert not any(owns(owners[i], t) for field in fresh for i, t in enumerate(field))


def _states(model: Transformer, rng: random.Random, n: int) -> list:
    w, vocab = model.cfg.window_size, model.cfg.vocab_size
    lengths = [rng.randrange(w, 5 * w) for _ in range(n)]
    prompts = [torch.tensor([[rng.randrange(16, vocab) for _ in range(t)]]) for t in lengths]
    return [prefill(model, p, mode="ced").state for p in prompts]


@torch.inference_mode()
def test_a_batched_pass_owns_what_it_made_and_clone_gives_it_up(model: Transformer) -> None:
    rng = random.Random(random.randrange(1 << 30))
    states = _states(model, rng, 3)
    decode_many(model, [rng.randrange(16, 64) for _ in states], states)
    for s in states:
        assert all(owns(s.owner, t) for t in _rings(s))
    copy = states[0].clone()
    assert not any(owns(states[0].owner, t) or owns(copy.owner, t) for t in _rings(states[0]))
    # a batched prefill's fresh rings are the state's too (its next decode step writes into them)
    chunk = torch.tensor([[rng.randrange(16, 64) for _ in range(5)]])
    prefill_many(model, [chunk, chunk], [states[1], states[2]])
    assert all(owns(states[1].owner, t) for t in states[1].windows)
    # marks name one state: another's token does not own them
    mark_owned(object(), [states[2].windows[0]])
    assert not owns(states[2].owner, states[2].windows[0])


def test_nothing_is_owned_or_written_in_place_outside_inference_mode(model: Transformer) -> None:
    rng = random.Random(random.randrange(1 << 30))
    with torch.no_grad():
        states = _states(model, rng, 2)
        for _ in range(2):
            decode_many(model, [rng.randrange(16, 64) for _ in states], states)
        assert not any(owns(s.owner, t) for s in states for t in _rings(s))


@torch.inference_mode()
def test_decode_many_in_place_equals_fresh_tensors_and_keeps_snapshots(model: Transformer) -> None:
    """Steps over a changing subset, with snapshots taken between them and then continued too: every
    logit and every state tensor equals the twin's, and a snapshot holds what its state held when taken
    until it is continued itself."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    base = _states(model, rng, 6)
    fast = [s.clone() for s in base]
    slow = [s.clone() for s in base]
    kept: list[tuple[int, object, list[torch.Tensor]]] = []  # (index, snapshot, its tensors when taken)
    for step in range(8):
        order = list(range(len(fast)))
        rng.shuffle(order)
        order = order[: rng.randrange(1, len(order) + 1)]
        tokens = [rng.randrange(16, model.cfg.vocab_size) for _ in order]
        got = decode_many(model, tokens, [fast[i] for i in order])
        ref = decode_many(model, tokens, [slow[i] for i in order], in_place=False)
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g.logits, r.logits), f"seed {seed} step {step}"
        for i in range(len(fast)):
            assert _same(_all_tensors(fast[i]), _all_tensors(slow[i])), f"seed {seed} step {step} seq {i}"
        for i, snap, held in kept:
            assert _same(_all_tensors(snap), held), f"seed {seed} step {step}: snapshot of {i} changed"
        if step in (1, 4):
            i = rng.randrange(len(fast))
            snap = fast[i].clone()
            kept.append((i, snap, [t.clone() for t in _all_tensors(snap)]))
            # the snapshot goes on as a state of its own beside the one it was taken of (a turn resumed
            # from a kept turn end), and its twin beside the twin's
            fast.append(snap.clone())
            slow.append(slow[i].clone())
