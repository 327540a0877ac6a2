"""Training pass against the model's own forward (its slow twin); the trainer's steps, resume and export."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from model import Transformer, init_random, load_model, prefill
from model.train import TrainStream
from model.train.family import sibling_config
from model.train.tokenizer import ByteTokenizer
from model.train.train_pass import PassMode, _evidence_loss, head_logits, train_pass
from model.train.trainer import (
    Trainer,
    TrainSpec,
    default_mixture,
    evidence_hints,
    export_checkpoint,
    phase_at,
)


def _capture(model: Transformer) -> tuple[dict[str, list[torch.Tensor]], list]:
    """Record every layer's attention input (attn_norm output) and attention output (wo_b output)."""
    rec: dict[str, list[torch.Tensor]] = {}
    handles = []
    for i, blk in enumerate(model.layers):
        for name, mod in ((f"in{i}", blk.attn_norm), (f"out{i}", blk.attn.wo_b)):
            handles.append(mod.register_forward_hook(
                lambda _m, _i, out, name=name: rec.setdefault(name, []).append(out.detach().clone())
            ))
    return rec, handles


@pytest.mark.parametrize(("name", "t"), [("v41-sib-s", 13), ("v41-sib-s", 70), ("v41-sib-l", 41)])
def test_train_pass_attention_matches_model_per_layer(name: str, t: int) -> None:
    """Each layer's dense training attention, fed the model's own layer input, equals `Transformer.run`
    (reference mode, sparse top-k, cache QDQ on) up to the sparse kernel's bf16 rounding."""
    from model.train.train_pass import _attention

    torch.manual_seed(t)
    model = init_random(Transformer(sibling_config(name)), seed=t)
    tokens = torch.randint(16, model.cfg.vocab_size, (2, t))
    rec, handles = _capture(model)
    model.run(tokens, model.new_state(2), start=0)
    for h in handles:
        h.remove()
    shared: dict = {"sources": {}}
    mode = PassMode(sparse=True, qdq=True, distill=False)
    with torch.no_grad():
        for i in range(model.cfg.n_layers):
            got = _attention(model, i, rec[f"in{i}"][0], shared, mode, [], {})
            want = rec[f"out{i}"][0]
            diff = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            assert diff <= 0.03 * scale, f"layer {i}: max diff {diff} vs max {scale}"


def test_train_pass_dense_equals_sparse_when_topk_covers_everything() -> None:
    """With fewer entries than index_topk the top-k keeps every visible entry: dense == sparse exactly."""
    model = init_random(Transformer(sibling_config("v41-sib-s")), seed=1).float()
    tokens = torch.randint(16, 4096, (1, 15))
    with torch.no_grad():
        dense = train_pass(model, tokens, PassMode(sparse=False)).hidden
        sparse = train_pass(model, tokens, PassMode(sparse=True)).hidden
    torch.testing.assert_close(dense, sparse, rtol=0, atol=0)


def test_train_pass_gradients_reach_every_trained_group() -> None:
    """The LM loss reaches every main-path parameter; the distillation KL reaches the indexers only."""
    model = init_random(Transformer(sibling_config("v41-sib-s")), seed=2).float()
    tokens = torch.randint(16, 4096, (2, 48))
    out = train_pass(model, tokens, PassMode(sparse=False, qdq=True))
    ce = torch.nn.functional.cross_entropy(head_logits(model, out.hidden[:, :-1]).flatten(0, 1),
                                           tokens[:, 1:].flatten())
    ce.backward(retain_graph=True)
    missing = [n for n, p in model.named_parameters() if p.grad is None and ".indexer." not in n
               and not n.endswith("gate.bias")]
    assert not missing, f"no LM gradient: {missing}"
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
    model.zero_grad(set_to_none=True)
    out.distill.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got and all(".indexer." in n for n in got), sorted(got)
    assert any("indexer.wk" in n for n in got) and any("weights_proj" in n for n in got)


def _stream(spec: TrainSpec) -> TrainStream:
    tok = ByteTokenizer()
    rng = np.random.default_rng(0)
    corpus = rng.integers(tok.specials.count, 256, size=5000)
    return TrainStream(spec.mixture, tok, corpus, [])


def _spec(steps: int = 3) -> TrainSpec:
    mix = default_mixture(batch_size=2, seq_len=96)
    return TrainSpec(model="v41-sib-s", steps=steps, mixture=mix, warmup=1, sparse_from=0.3, qdq_from=0.6,
                     log_every=1, save_every=2)


def test_trainer_resume_continues_bit_identically(tmp_path) -> None:
    """One step, save, resume in a fresh Trainer, two more == three steps in one go (one per phase); the
    exported checkpoint loads through the normal path and runs."""
    spec = _spec()
    torch.set_num_threads(2)
    straight = Trainer(spec, tmp_path / "a", stream=_stream(spec))
    straight.run()
    first = Trainer(spec, tmp_path / "b", stream=_stream(spec))
    first.run(until=1)
    second = Trainer(spec, tmp_path / "b", stream=_stream(spec))
    assert second.step == 1
    second.run()
    want, got = straight.model.state_dict(), second.model.state_dict()
    for n, a in want.items():
        torch.testing.assert_close(a, got[n], rtol=0, atol=0, msg=n)
    lines = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in lines if r["event"] == "train_step"]
    assert phases == ["dense", "sparse", "sparse_qdq"]
    out = export_checkpoint(second.model, tmp_path / "ckpt")
    model = load_model(out)
    assert next(model.embed.parameters()).dtype == torch.bfloat16
    logits = prefill(model, torch.randint(16, 4096, (1, 40)), mode="ced").logits
    assert logits is not None and torch.isfinite(logits).all()


def test_train_spec_schedule() -> None:
    spec = TrainSpec(model="v41-sib-s", steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert spec.lr_at(0) == pytest.approx(1e-4)
    assert spec.lr_at(9) == pytest.approx(1e-3)
    assert spec.lr_at(100) == pytest.approx(1e-4)
    phases = [phase_at(spec, s)[0] for s in (0, 59, 60, 84, 85)]
    assert phases == ["dense"] * 2 + ["sparse"] * 2 + ["sparse_qdq"]
    assert TrainSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="sparse_from"):
        TrainSpec(model="v41-sib-s", steps=10, sparse_from=0.9, qdq_from=0.5)
    with pytest.raises(ValueError, match="unknown sibling"):
        TrainSpec(model="nope", steps=10)


def test_evidence_hints_point_at_the_token_to_copy() -> None:
    """Every hint (row, query position q, entry e) of a key-value batch has e <= q and the evidence token at
    e equal to the token the row at q must predict; every answer token gets one."""
    spec = _spec()
    batch = _stream(spec).batch(0)
    hints = evidence_hints(batch)
    n_answer_tokens = sum(a.end - a.start for row in batch.answers for a in row if a.kind == "kv_recall")
    assert hints.size(0) == n_answer_tokens > 0
    b, q, e = hints.unbind(-1)
    assert (e <= q).all()
    assert torch.equal(batch.tokens[b, e], batch.targets[b, q])


def test_evidence_loss_matches_a_loop_twin() -> None:
    """-log(head-mean probability + 1e-6), averaged over the hints whose entry is selected."""
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(3, 4, 20, 20, generator=g), dim=-1)
    sel = torch.rand(3, 20, 20, generator=g) > 0.3
    hints = torch.stack([torch.randint(0, 3, (40,), generator=g), torch.randint(0, 20, (40,), generator=g),
                         torch.randint(0, 20, (40,), generator=g)], dim=-1)
    want = [-np.log(float(p[b, :, q, e].mean()) + 1e-6) for b, q, e in hints.tolist() if sel[b, q, e]]
    got = _evidence_loss(p, sel, hints)
    assert got is not None and float(got) == pytest.approx(float(np.mean(want)), rel=1e-5)
    assert _evidence_loss(p, torch.zeros_like(sel), hints) is None


def test_evidence_loss_trains_the_retrieval_path_only() -> None:
    """The evidence term reaches the candidate-source layer's query and the layers below it (which build its
    entries), never the layers above it or the head; a config without a ratio-1 candidate source refuses
    hints."""
    cfg = sibling_config("v41-sib-s")
    model = init_random(Transformer(cfg), seed=3).float()
    tokens = torch.randint(16, 4096, (2, 40))
    hints = torch.tensor([[0, 30, 5], [1, 39, 12], [1, 20, 20]])
    out = train_pass(model, tokens, PassMode(sparse=False), hints)
    assert float(out.evidence.detach()) > 0
    out.evidence.backward()
    src = cfg.candidate_source_layer
    touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(n.startswith(f"layers.{src}.attn.wq_b") for n in touched)
    assert any(n.startswith(f"layers.{src}.attn.compressor") for n in touched)
    assert any(n.startswith("layers.0.") for n in touched)
    above = [n for n in touched if n.startswith("head") or any(
        n.startswith(f"layers.{i}.") for i in range(src + 1, cfg.n_layers))]
    assert not above, above
    with pytest.raises(ValueError, match="candidate_source_layer"):
        no_pool = dataclasses.replace(cfg, candidate_source_layer=-1)
        train_pass(init_random(Transformer(no_pool)).float(), tokens, PassMode(), hints)
