"""fit_mapper between random-init models (different widths; same weights under another RoPE theta),
evaluate_mapper on the identity, and the gate."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from mappers import (
    FitSpec,
    GateSpec,
    RidgeMapper,
    apply_mapper,
    evaluate_mapper,
    fit_mapper,
    gate_failures,
    gate_mapper,
    identity_mapper,
    load_mapper,
    save_mapper,
)
from model import (
    Transformer,
    init_random,
    load_preset,
    model_fingerprint,
    prefill,
    state_from_global,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sender() -> Transformer:
    return init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()


def _batches(n: int, b: int, t: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


@torch.inference_mode()
def test_fit_mapper_between_widths_imports_and_continues(sender: Transformer, tmp_path: Path) -> None:
    r_cfg = dataclasses.replace(
        sender.cfg, dim=128, q_lora_rank=64, o_lora_rank=64, head_dim=64, rope_head_dim=16, index_head_dim=32
    )
    receiver = init_random(Transformer(r_cfg), seed=1).eval()
    mapper = fit_mapper(
        sender,
        receiver,
        _batches(2, 2, 96, seed=1),
        heldout_batches=_batches(1, 2, 96, seed=2),
        spec=FitSpec(alphas=(1e-2, 1.0), index_mode="best"),
        sender_name="tiny-256",
        receiver_name="tiny-128",
    )
    assert [lm.receiver_layer for lm in mapper.layers] == [2, 4, 6]
    for lm in mapper.layers:
        coef, intercept = mapper.weights(lm.receiver_layer, "kv")
        assert coef.shape == (64, 128 * len(lm.kv.sender_layers))
        assert torch.isfinite(coef).all() and torch.isfinite(intercept).all()
        for key in ("r2_kv_train", "r2_kv_heldout", "r2_index_train", "r2_index_heldout"):
            assert key in lm.quality and lm.quality[key] <= 1.0, key
        # "best" keeps the separate index map unless recomputing from the mapped latent scores higher
        better = lm.quality["r2_index_recompute_heldout"] > lm.quality["r2_index_heldout"]
        assert lm.index.kind == ("recompute" if better else "linear")
        # in-sample R² of a ridge fit is never below the constant predictor's 0
        assert lm.quality["r2_kv_train"] >= 0.0
    assert not mapper.passed_gate and "r2_kv_heldout_mean" in mapper.quality
    save_mapper(mapper, tmp_path / "m")
    mapper = load_mapper(tmp_path / "m")

    fp_s, fp_r = model_fingerprint(sender), model_fingerprint(receiver)
    toks = _batches(1, 1, 50, seed=3)[0]
    s_state = prefill(sender, toks).state
    mapped = apply_mapper(
        mapper, s_state, sender_fingerprint=fp_s, receiver_fingerprint=fp_r, chunk_tokens=16,
        receiver_model=receiver,
    )
    assert mapped.bounds == ((0, 16), (16, 32), (32, 48), (48, 50))
    r_state = state_from_global(receiver, toks, list(mapped.blobs), fingerprint=fp_r)
    assert r_state.sources[2].n_entries == 25 and r_state.sources[6].n_entries == 50
    out = prefill(receiver, _batches(1, 1, 6, seed=4)[0], r_state)
    assert out.logits is not None and torch.isfinite(out.logits).all()
    assert out.state.n_tokens == 56


@torch.inference_mode()
def test_fit_mapper_finds_the_same_layer_in_content_space(sender: Transformer) -> None:
    # same weights, another compressed-layer RoPE theta: layer 2's pre-RoPE latent is identical in both
    # (layers 0-1 are window-only), so a content-space map of it is near-identity, a rotated-space one not
    r_cfg = dataclasses.replace(sender.cfg, compress_rope_theta=10000.0, original_seq_len=0)
    receiver = Transformer(r_cfg)
    receiver.load_state_dict(sender.state_dict())
    receiver.eval()
    train, held = _batches(2, 2, 112, seed=5), _batches(1, 2, 96, seed=6)
    mapper = fit_mapper(sender, receiver, train, heldout_batches=held, spec=FitSpec(k=1, alphas=(1e-4,)))
    assert [lm.kv.sender_layers for lm in mapper.layers] == [(2,), (4,), (6,)]
    r2 = mapper.layer(2).quality["r2_kv_heldout"]
    assert r2 > 0.98, f"content-space held-out R² {r2:.4f}"

    # slow twin of the same question on rotated (stored) entries: a linear map cannot undo a position-
    # dependent rotation, so it explains clearly less
    def rotated(model: Transformer, batches: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([prefill(model, t).state.sources[2].kv.float().flatten(0, 1) for t in batches])

    fit = RidgeMapper(1e-4).fit(rotated(sender, train), rotated(receiver, train))
    x_held, y_held = rotated(sender, held), rotated(receiver, held)
    err = ((fit.predict(x_held) - y_held) ** 2).sum()
    r2_rotated = float(1 - err / ((y_held - y_held.mean(0)) ** 2).sum())
    assert r2_rotated < r2 - 0.05, f"rotated-space R² {r2_rotated:.4f} vs content-space {r2:.4f}"


@torch.inference_mode()
def test_evaluate_mapper_identity_is_exact_and_gate_mapper(sender: Transformer) -> None:
    mapper = identity_mapper(sender.cfg, sender.cfg)
    prompts = _batches(1, 2, 72, seed=7)[0]
    ev = evaluate_mapper(mapper, sender, sender, prompts, suffix_tokens=8)
    assert ev.prefix_tokens == 64 and ev.n_prompts == 2
    assert ev.mapping_kl == 0.0
    assert ev.next_token_kl == pytest.approx(ev.replay_kl)
    assert all(v == 1.0 for v in ev.index_recall.values())
    assert all(v == 1.0 for v in ev.r2_kv.values()) and all(v == 1.0 for v in ev.r2_index.values())
    assert min(ev.attn_cosine.values()) > 0.999999
    figures = ev.figures()
    assert set(ev.attn_cosine) == set(range(12)) and figures["attn_cosine_cold_mean"] <= 1.0

    # screens only (the retention interval switched off): the identity passes them
    screens = GateSpec(min_attn_cosine=0.99, max_next_token_kl=None, min_retention_lower=None)
    gated, failed = gate_mapper(mapper, ev, gate=screens)
    assert gated.passed_gate and failed == []
    # with the default interval gate, screens cannot accept on their own
    default_interval = GateSpec(min_attn_cosine=0.99, max_next_token_kl=None)
    assert not gate_mapper(mapper, ev, gate=default_interval)[0].passed_gate
    assert gated.layer(4).quality["eval_index_recall"] == 1.0
    strict = GateSpec(min_attn_cosine=0.99, max_next_token_kl=ev.replay_kl / 2, min_retention_lower=None)
    gated, failed = gate_mapper(mapper, ev, gate=strict)
    assert not gated.passed_gate and failed and "next_token_kl" in failed[0]
    with pytest.raises(ValueError, match="suffix_tokens"):
        evaluate_mapper(mapper, sender, sender, prompts, suffix_tokens=40)


def test_gate_failures_names_each_condition() -> None:
    gate = GateSpec(min_attn_cosine=0.9, max_next_token_kl=0.2, min_index_recall=0.5, min_retention=0.8)
    figures = {"attn_cosine_mean": 0.95, "next_token_kl": 0.3, "index_recall": 0.5}
    failed = gate_failures(gate, figures)
    assert failed == [
        "next_token_kl=0.3 fails max_next_token_kl=0.2",
        "retention not measured (gate min_retention=0.8)",
        "retention_ci_lower not measured (gate min_retention_lower=0.8)",
    ]
    passing = figures | {"next_token_kl": 0.2, "retention": 0.8, "retention_ci_lower": 0.8}
    assert gate_failures(gate, passing) == []
    assert gate_failures(gate, passing | {"retention_ci_lower": 0.79}) == [
        "retention_ci_lower=0.79 fails min_retention_lower=0.8"
    ]
