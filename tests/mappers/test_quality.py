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


def _shipped_or_skip(name: str):
    import os
    from pathlib import Path

    from model import load_model

    path = Path(__file__).resolve().parents[2] / "checkpoints" / name
    if not (path / "model.safetensors").is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"shipped checkpoint {path} is missing")
        pytest.skip(f"no shipped checkpoint at {path}")
    return load_model(path).eval()


@torch.inference_mode()
def test_task_retention_of_the_identity_map_equals_own_replay() -> None:
    """A trained sibling mapped onto itself by the identity map: the mapped run IS the own-replay run (same
    bytes), the sender and the receiver score alike, the figures are fractions, and a bad suffix, a span
    outside it or a row count mismatch is refused."""
    from mappers import evaluate_task_retention
    from model.train.family import FAMILY_RECALL_TASK
    from model.train.quality import recall_episodes
    from model.train.quality_report import heldout_filler

    model = _shipped_or_skip("v41-sib-s")
    tok, filler = heldout_filler()
    eps = recall_episodes(tok, filler, 8 * model.cfg.window_size, 6, seed=7, kv=FAMILY_RECALL_TASK)
    spans = [(a.start, a.end) for a in eps.answers]
    ident = identity_mapper(model.cfg, model.cfg)
    w = model.cfg.window_size
    got = evaluate_task_retention(ident, model, model, eps.tokens, spans, suffix_tokens=w)
    assert got.n == 6 and got.mapped_acc == got.replay_acc and got.sender_acc == got.receiver_acc
    for v in got.figures().values():
        assert v >= 0.0
    assert 0.0 <= got.floor_acc <= 1.0
    with pytest.raises(ValueError, match="suffix_tokens"):
        evaluate_task_retention(ident, model, model, eps.tokens, spans, suffix_tokens=w + 1)
    with pytest.raises(ValueError, match="not inside the suffix"):
        evaluate_task_retention(ident, model, model, eps.tokens, [(1, 2)] * 6, suffix_tokens=w)
    with pytest.raises(ValueError, match="answer spans for"):
        evaluate_task_retention(ident, model, model, eps.tokens, spans[:2], suffix_tokens=w)
