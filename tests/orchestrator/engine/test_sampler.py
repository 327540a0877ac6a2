"""Sampler: greedy at temperature 0; seeded sampling reproducible; top-k 1 and tiny top-p are greedy."""

from __future__ import annotations

import pytest
import torch

from orchestrator.api import GenerationSpec
from orchestrator.engine import Sampler
from orchestrator.engine.sampler import ChosenToken, greedy_token
from orchestrator.scheduler import DecodeChain


def test_sampler_greedy_and_seeded() -> None:
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(1, 97, generator=g) for _ in range(20)]
    greedy = Sampler(GenerationSpec(max_new_tokens=1))
    assert [greedy(x) for x in logits] == [int(x.argmax()) for x in logits]
    spec = GenerationSpec(max_new_tokens=1, temperature=1.0, seed=42)
    a, b = Sampler(spec), Sampler(spec)
    assert [a(x) for x in logits] == [b(x) for x in logits]
    top1 = Sampler(GenerationSpec(max_new_tokens=1, temperature=2.0, top_k=1, seed=1))
    assert [top1(x) for x in logits] == [int(x.argmax()) for x in logits]
    nucleus = Sampler(GenerationSpec(max_new_tokens=1, temperature=1.0, top_p=1e-6, seed=1))
    assert [nucleus(x) for x in logits] == [int(x.argmax()) for x in logits]
    # with the full distribution, some draws differ from the argmax (the sampler does sample)
    full = Sampler(GenerationSpec(max_new_tokens=1, temperature=5.0, seed=3))
    assert [full(x) for x in logits] != [int(x.argmax()) for x in logits]


def test_sampler_tiny_temperature_is_greedy_not_nan() -> None:
    # 1e-38 used to overflow logits / T to inf, and softmax(inf - inf) drew from NaN probabilities
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(1, 97, generator=g) * 30 for _ in range(20)]
    for temperature in (1e-38, 1e-30, 1e-6):
        for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.9)):
            tiny = Sampler(GenerationSpec(max_new_tokens=1, temperature=temperature, top_k=top_k,
                                          top_p=top_p, seed=7))
            assert [tiny(x) for x in logits] == [int(x.argmax()) for x in logits]


def test_generation_spec_rejects_non_finite_temperature() -> None:
    for bad in (float("inf"), float("nan"), -1e-9):
        with pytest.raises(ValueError, match=f"temperature={bad} must be finite and >= 0"):
            GenerationSpec(max_new_tokens=1, temperature=bad)


def test_greedy_sampler_equals_argmax_of_the_flat_fp32_row_on_random_logits() -> None:
    """The greedy fast path (argmax where the logits are) against its slow twin, the argmax of the flat
    fp32 CPU copy: random shapes, dtypes, ties (rounded values), a non-contiguous view, -inf."""
    import secrets

    gen = torch.Generator().manual_seed(secrets.randbits(62))
    sampler = Sampler(GenerationSpec(max_new_tokens=1, temperature=0.0))
    for trial in range(200):
        # now and then a real vocabulary's size (numpy's vectorised argmax runs in blocks)
        vocab = int(torch.randint(1, 700, (1,), generator=gen)) if trial % 25 else 32000 + trial
        logits = torch.randn(2, vocab, generator=gen) * 4
        if trial % 3 == 0:
            logits = logits.round()  # many ties: the first maximal index must win alike
        if trial % 7 == 0:
            logits[:, : vocab // 2] = -torch.inf
        if trial % 11 == 0:
            # NaN counts as the maximum on both paths (the fp32 CPU path is numpy's argmax)
            logits[:, torch.randint(0, vocab, (3,), generator=gen)] = torch.nan
        if trial % 13 == 0:
            logits[:, torch.randint(0, vocab, (2,), generator=gen)] = torch.inf
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for view in (logits[:1].to(dtype), logits[1].to(dtype), logits.to(dtype).t()[:, :1].t()):
                want = int(view.reshape(-1).float().cpu().argmax())
                assert sampler(view) == want, (trial, dtype, view.shape)


def test_a_greedy_choice_made_elsewhere_is_taken_only_by_a_greedy_sampler() -> None:
    """`ChosenToken` (the model process's greedy choice, `greedy_token`, made on the very logits): a greedy
    sampler returns it; one that draws at a temperature refuses it, naming the temperature. And
    `greedy_token` is the sampler's own greedy pick: first maximal index, NaN counted as the maximum."""
    g = torch.Generator().manual_seed(7)
    greedy = Sampler(GenerationSpec(max_new_tokens=1))
    assert greedy.greedy and greedy(ChosenToken(41)) == 41
    for x in [torch.randn(1, 97, generator=g) for _ in range(10)]:
        assert greedy_token(x) == greedy(x) == int(x.argmax())
    tie = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert greedy_token(tie) == 1
    nan = torch.tensor([[1.0, float("nan"), 5.0]])
    assert greedy_token(nan) == greedy(nan) == 1
    warm = Sampler(GenerationSpec(max_new_tokens=1, temperature=0.7, seed=1))
    assert not warm.greedy
    with pytest.raises(ValueError, match="temperature 0.7"):
        warm(ChosenToken(3))
    # a decode chain reads from its sampler whether a greedy choice will do (what its passes ask for)
    assert DecodeChain(greedy, stops=(), max_new_tokens=1, persist=False).greedy
    assert not DecodeChain(warm, stops=(), max_new_tokens=1, persist=False).greedy
    assert not DecodeChain(lambda logits: 0, stops=(), max_new_tokens=1, persist=False).greedy
