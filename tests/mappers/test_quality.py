"""Slow: on a related pair (a sibling and a perturbed copy, plain bf16 weights) the fitted ridge mapper
beats the identity map it would otherwise be compared with, on held-out prompts."""

from __future__ import annotations

import pytest
import torch

from mappers import evaluate_mapper, fit_mapper, identity_mapper
from model import Transformer, init_random
from model.train.family import sibling_config


@pytest.mark.slow
@torch.inference_mode()
def test_fit_mapper_beats_identity_on_a_perturbed_sibling() -> None:
    cfg = sibling_config("v41-sib-s")
    sender = init_random(Transformer(cfg), seed=0).eval()
    receiver = init_random(Transformer(cfg), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    for name, p in receiver.named_parameters():
        if p.is_floating_point() and p.numel() > 1 and not name.endswith("norm.weight"):
            p.add_((torch.randn(p.shape, generator=g) * p.float().std() * 0.2).to(p.dtype))
    v = cfg.vocab_size
    train = [torch.randint(0, v, (4, 128), generator=g) for _ in range(4)]
    held = [torch.randint(0, v, (4, 128), generator=g)]
    prompts = torch.randint(0, v, (4, 72), generator=g)
    fitted = evaluate_mapper(
        fit_mapper(sender, receiver, train, heldout_batches=held), sender, receiver, prompts, suffix_tokens=8
    )
    ident = evaluate_mapper(identity_mapper(cfg, cfg), sender, receiver, prompts, suffix_tokens=8)
    f, i = fitted.figures(), ident.figures()
    assert f["r2_kv_mean"] > i["r2_kv_mean"] and f["r2_index_mean"] > i["r2_index_mean"], (f, i)
    assert f["mapping_kl"] < i["mapping_kl"], (f, i)
    assert f["attn_cosine_mean"] > 0.8 and f["index_recall"] > 0.6, f
