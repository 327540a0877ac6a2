"""`model.greedy`: the uninterrupted reference of the service's bit-identity checks."""

from __future__ import annotations

import pytest
import torch

from model import Transformer, decode, greedy, init_random, prefill
from model.train.family import sibling_config


@torch.inference_mode()
def test_greedy_is_prefill_then_decode_steps() -> None:
    model = init_random(Transformer(sibling_config("v41-sib-s")), seed=4).eval()
    prompt = torch.randint(16, 4096, (1, 37), generator=torch.Generator().manual_seed(4))
    out = prefill(model, prompt, mode="ced")
    want = [int(out.logits.argmax(-1))]
    state = out.state
    for _ in range(3):
        step = decode(model, torch.tensor([want[-1]]), state)
        state = step.state
        want.append(int(step.logits.argmax(-1)))
    assert greedy(model, prompt, 4) == want
    assert greedy(model, prompt, 1) == want[:1]
    with pytest.raises(ValueError, match="n=0"):
        greedy(model, prompt, 0)
