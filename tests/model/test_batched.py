"""`decode_many` (one step over the stacked rows of many sequences) equals decoding each sequence alone,
bit for bit: logits, every state tensor and the exported cache bytes, on fresh random states of unequal
lengths that straddle window and compression-group boundaries. Also the row-invariance of the products
the batched step relies on."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from model import Transformer, decode, decode_many, export_global, init_random, load_preset, prefill
from model.invariant import rowwise_linear


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return init_random(Transformer(load_preset("v41-tiny")), seed=int(torch.randint(0, 10_000, ()))).eval()


def _state_tensors(state) -> list[torch.Tensor]:
    out = [state.tokens, state.enc_lanes, state.enc_pre]
    out += list(state.windows) + list(state.window_codes) + list(state.window_scales)
    for layer in sorted(state.sources):
        src = state.sources[layer]
        out += [src.kv, src.index_k, src.kv_packed, src.kv_scales, src.index_packed, src.index_scales]
        out += [t for t in (src.carry_kv, src.carry_score) if t is not None]
    return out


def _assert_same_state(a, b) -> None:
    assert a.window_from == b.window_from and a.enc_from == b.enc_from
    assert a.extra.get("index_k_slot") == b.extra.get("index_k_slot")
    for k, (x, y) in enumerate(zip(_state_tensors(a), _state_tensors(b), strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape
        # compare the bytes: NaN payloads and signed zeros count, fp8 codes and e8m0 scales too
        x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        assert torch.equal(x, y), f"state tensor {k} differs at {int((x != y).nonzero()[0, 0])}"


def test_rowwise_linear_equals_one_row_products() -> None:
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    for k, n in ((384, 24), (96, 4096), (1000, 7)):
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(37, k, generator=gen)
        alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(37)])
        assert torch.equal(rowwise_linear(x, w), alone)
        assert torch.equal(rowwise_linear(x[:1], w), F.linear(x[:1], w))


@torch.inference_mode()
def test_decode_many_equals_each_sequence_decoded_alone(model: Transformer) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    cfg = model.cfg
    w = cfg.window_size
    # lengths around the window and the compression groups, plus a fresh 1-token state
    lengths = [1, 3, w - 1, w, w + 1, 2 * w + 3] + [rng.randrange(2, 4 * w) for _ in range(14)]
    states = []
    for n in lengths:
        prompt = torch.tensor([[rng.randrange(16, cfg.vocab_size) for _ in range(n)]])
        states.append(prefill(model, prompt, mode="ced").state)
    alone = [s.clone() for s in states]
    together = [s.clone() for s in states]
    for step in range(6):  # crosses group boundaries of every ratio at some lengths
        tokens = [rng.randrange(16, cfg.vocab_size) for _ in states]
        ref = [decode(model, torch.tensor([t]), s) for t, s in zip(tokens, alone, strict=True)]
        # a different subset and order each step: who shares the batch must not matter
        order = list(range(len(states)))
        rng.shuffle(order)
        order = order[: rng.randrange(1, len(order) + 1)] if step % 2 else order
        got = decode_many(model, [tokens[i] for i in order], [together[i] for i in order])
        for j, i in enumerate(order):
            assert torch.equal(got[j].logits, ref[i].logits), f"seed {seed} step {step} seq {i}"
            assert got[j].stats == ref[i].stats
        # the sequences left out of this step are decoded alone, to stay in lockstep with the reference
        for i in set(range(len(states))) - set(order):
            decode(model, torch.tensor([tokens[i]]), together[i])
        for i in range(len(states)):
            _assert_same_state(alone[i], together[i])
    for a, b in zip(alone, together, strict=True):
        assert export_global(a, 0, a.n_tokens, fingerprint=b"f" * 32) == export_global(
            b, 0, b.n_tokens, fingerprint=b"f" * 32
        )


def test_decode_many_refuses_bad_batches(model: Transformer) -> None:
    state = model.new_state(1)
    with pytest.raises(ValueError, match="one token per state"):
        decode_many(model, [1, 2], [state])
    with pytest.raises(ValueError, match="same state twice"):
        decode_many(model, [1, 2], [state, state])
    with pytest.raises(ValueError, match="must lie in"):
        decode_many(model, [cfg_vocab := model.cfg.vocab_size], [state])
    assert cfg_vocab > 0
