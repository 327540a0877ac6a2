"""A decode step of one sequence runs as the lone `decode` (TorchCompute.decode_many): the same logits and
state as `model.decode_many` on fresh random histories of a seeded v41-tiny, several steps in a row; two
sequences and a refused token id still go to `decode_many`."""

from __future__ import annotations

import random

import pytest
import torch

import orchestrator.engine.model_compute as model_compute
from model import decode_many, prefill
from orchestrator.engine import TorchCompute

_TORCH = TorchCompute()


def _state(served, rng: random.Random):
    vocab = served.model.cfg.vocab_size
    n = rng.randrange(20, 90)
    prompt = torch.tensor([[rng.randrange(vocab) for _ in range(n)]])
    with torch.inference_mode():
        return prefill(served.model, prompt, mode="ced", prompt_end=n).state


def _same_state(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens)
    rings_a = a.windows + a.window_codes + a.window_scales
    rings_b = b.windows + b.window_codes + b.window_scales
    for x, y in zip(rings_a, rings_b, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert a.window_from == b.window_from
    for layer, src in a.sources.items():
        other = b.sources[layer]
        for name in ("kv", "index_k", "kv_packed", "kv_scales", "index_packed", "index_scales"):
            mine, theirs = getattr(src, name), getattr(other, name)
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name


def test_one_sequence_takes_the_lone_decode_with_decode_many_bits(served, monkeypatch) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    batched_calls: list[int] = []
    real = model_compute.decode_many

    def counted(model, tokens, states, **kw):
        batched_calls.append(len(states))
        return real(model, tokens, states, **kw)

    monkeypatch.setattr(model_compute, "decode_many", counted)
    vocab = served.model.cfg.vocab_size
    for _ in range(3):
        mine = _state(served, rng)
        twin = mine.clone()
        for _ in range(rng.randrange(1, 6)):
            token = rng.randrange(vocab)
            (got,) = _TORCH.decode_many(served, [token], [mine])
            with torch.inference_mode():
                (want,) = decode_many(served.model, [token], [twin])
            assert torch.equal(got.logits, want.logits), f"seed {seed}"
            assert got.stats == want.stats
            mine, twin = got.state, want.state
        _same_state(mine, twin)
    assert batched_calls == [], "a one-sequence step went through decode_many"
    a, b = _state(served, rng), _state(served, rng)
    _TORCH.decode_many(served, [1, 2], [a, b])
    assert batched_calls == [2]
    with pytest.raises(ValueError, match=str(vocab)):
        _TORCH.decode_many(served, [vocab], [a])
    assert batched_calls == [2, 1]
