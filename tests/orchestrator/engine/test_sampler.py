"""Sampler: greedy at temperature 0; seeded sampling reproducible; top-k 1 and tiny top-p are greedy."""

from __future__ import annotations

import torch

from orchestrator.api import GenerationSpec
from orchestrator.engine import Sampler


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
