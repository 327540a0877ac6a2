"""The mlp fallback part: features, the batched apply against its per-row twin, the per-part choice in
fit_mapper, the v2 artifact round trip (and v1 artifacts still loading), and apply through chunks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mappers import (
    FitSpec,
    MlpFeatures,
    apply_mapper,
    build_features,
    fit_mapper,
    load_mapper,
    mlp_predict,
    mlp_predict_rows,
    save_mapper,
)
from mappers.mlp import fit_mlp_residual
from model import Transformer, export_global, init_random, load_preset, model_fingerprint, prefill


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _arrays(g: torch.Generator, d_in: int, width: int, hidden: int, d_out: int) -> dict[str, torch.Tensor]:
    return {
        "coef": torch.randn(d_out, d_in, generator=g) * 0.3,
        "intercept": torch.randn(d_out, generator=g),
        "mu": torch.randn(width, generator=g),
        "sigma": torch.rand(width, generator=g) + 0.5,
        "w1": torch.randn(hidden, width, generator=g) * width**-0.5,
        "b1": torch.randn(hidden, generator=g) * 0.1,
        "w2": torch.randn(d_out, hidden, generator=g) * hidden**-0.5,
        "b2": torch.randn(d_out, generator=g) * 0.1,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mlp_predict_matches_its_per_row_twin(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d_in, width, hidden, d_out = 12, 20, 16, 8
    arrays = _arrays(g, d_in, width, hidden, d_out)
    x = torch.randn(2, 5, d_in, generator=g)
    f = torch.randn(2, 5, width, generator=g)
    fast = mlp_predict(arrays, x, f)
    slow = mlp_predict_rows(arrays, x, f)
    assert fast.shape == slow.shape == (2, 5, d_out)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_build_features_context_other_ratio_and_embeddings() -> None:
    g = torch.Generator().manual_seed(5)
    own = [torch.randn(1, 6, 4, generator=g)]
    coarse = torch.randn(1, 3, 3, generator=g)  # ratio 2: entries of tokens [0,2), [2,4), [4,6)
    emb = torch.randn(1, 6, 2, generator=g)
    feats = MlpFeatures(context=1, other_layers=(7,), embed=True, hidden=4)
    f = build_features(own, {7: (2, coarse)}, feats, 1, 6, embed_rows=emb)
    assert f.shape == (1, 6, 4 + 4 + 3 + 2)
    torch.testing.assert_close(f[0, 3, :4], own[0][0, 3])
    torch.testing.assert_close(f[0, 3, 4:8], own[0][0, 2])  # the previous entry
    assert torch.equal(f[0, 0, 4:8], torch.zeros(4))  # nothing before entry 0
    torch.testing.assert_close(f[0, 3, 8:11], coarse[0, 1])  # token 3 lies in coarse entry 1
    torch.testing.assert_close(f[0, 3, 11:], emb[0, 3])
    # a ratio-2 part reading a ratio-1 source averages the two entries inside it
    fine = torch.randn(1, 6, 3, generator=g)
    flat = MlpFeatures(context=0, other_layers=(9,), embed=False)
    f2 = build_features([coarse], {9: (1, fine)}, flat, 2, 3)
    torch.testing.assert_close(f2[0, 1, 3:], fine[0, 2:4].mean(0))
    with pytest.raises(ValueError, match="embed_rows"):
        build_features(own, {7: (2, coarse)}, feats, 1, 6)


def test_fit_mlp_residual_learns_a_nonlinear_residual() -> None:
    g = torch.Generator().manual_seed(7)
    f = torch.randn(2048, 6, generator=g)
    target = torch.stack([torch.sin(2 * f[:, 0]) * f[:, 1], f[:, 2].abs()], -1)
    arrays = fit_mlp_residual(f, target, hidden=64, epochs=30, batch=128, lr=3e-3)
    zero = {"coef": torch.zeros(2, 1), "intercept": torch.zeros(2)}
    pred = mlp_predict(arrays | zero, torch.zeros(2048, 1), f)
    sst = ((target - target.mean(0)) ** 2).sum()
    r2 = 1 - ((pred - target) ** 2).sum() / sst
    # the best linear map of the same features explains almost none of it (both targets are even or odd
    # products the features do not hold linearly)
    design = torch.cat([f, torch.ones(2048, 1)], 1)
    lin = design @ torch.linalg.lstsq(design, target).solution
    r2_lin = 1 - ((lin - target) ** 2).sum() / sst
    assert r2_lin < 0.1 and r2 > 0.5


def _batches(n: int, b: int, t: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (b, t), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def fitted() -> tuple[Transformer, Transformer, object]:
    sender = init_random(Transformer(load_preset("v41-tiny")), seed=0).eval()
    receiver = init_random(Transformer(load_preset("v41-tiny")), seed=3).eval()
    spec = FitSpec(alphas=(1e-2,), fallback="mlp", part_gate_r2=0.99, mlp_epochs=2, mlp_hidden=32)
    with torch.inference_mode():
        mapper = fit_mapper(sender, receiver, _batches(2, 2, 64, 1), heldout_batches=_batches(1, 2, 64, 2),
                            spec=spec, calibration={"task_seeds": [5], "corpus": {"kind": "random_ids"}})
    return sender, receiver, mapper


def test_fit_tries_the_mlp_only_where_ridge_fails_and_says_why(fitted) -> None:
    _, _, mapper = fitted
    for lm in mapper.layers:
        for part in ("kv", "index"):
            pm = lm.part(part)
            ridge, mlp = lm.quality[f"r2_{part}_heldout"], lm.quality[f"r2_{part}_mlp_heldout"]
            assert ridge < 0.99 and pm.reason
            assert pm.kind == ("mlp" if mlp > ridge else "linear"), (lm.receiver_layer, part)
            assert ("mlp held-out R²" in pm.reason) == (pm.kind == "mlp")
    assert mapper.fit_task_seeds == (5,)
    # a part gate every ridge passes keeps ridge everywhere, with the reason
    spec = FitSpec(alphas=(1e-2,), fallback="mlp", part_gate_r2=-1e9)
    sender, receiver, _ = fitted
    with torch.inference_mode():
        plain = fit_mapper(sender, receiver, _batches(1, 2, 64, 1), heldout_batches=_batches(1, 2, 64, 2),
                           spec=spec)
    assert all(lm.part(p).kind == "linear" and ">= part gate" in lm.part(p).reason
               for lm in plain.layers for p in ("kv", "index"))


def test_force_mlp_tries_the_mlp_on_a_part_that_passes_the_part_gate(fitted) -> None:
    sender, receiver, _ = fitted
    layer = receiver.cfg.kv_source_layers[-1]
    spec = FitSpec(alphas=(1e-2,), fallback="mlp", part_gate_r2=-1e9, mlp_epochs=2, mlp_hidden=32,
                   force_mlp=(f"{layer}.kv",))
    with torch.inference_mode():
        mapper = fit_mapper(sender, receiver, _batches(2, 2, 64, 1), heldout_batches=_batches(1, 2, 64, 2),
                            spec=spec)
    for lm in mapper.layers:
        for part in ("kv", "index"):
            pm, q = lm.part(part), lm.quality
            if (lm.receiver_layer, part) == (layer, "kv"):
                # tried although ridge passed; kept only when better on held-out rows
                assert f"forced ({layer}.kv)" in pm.reason and ">= part gate" in pm.reason
                assert pm.kind == ("mlp" if q["r2_kv_mlp_heldout"] > q["r2_kv_heldout"] else "linear")
            else:
                assert pm.kind == "linear" and f"r2_{part}_mlp_heldout" not in q
    assert mapper.calibration["fit_spec"]["force_mlp"] == (f"{layer}.kv",)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"force_mlp": ("6.kv",)}, "needs fallback='mlp'"), ({"fallback": "mlp", "force_mlp": ("kv6",)}, "kv6"),
     ({"fallback": "mlp", "force_mlp": ("6.value",)}, "6.value")],
)
def test_force_mlp_refuses_bad_names(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FitSpec(**kwargs)


def test_force_mlp_refuses_a_layer_that_is_not_a_receiver_source(fitted) -> None:
    sender, receiver, _ = fitted
    with pytest.raises(ValueError, match="99.kv"), torch.inference_mode():
        fit_mapper(sender, receiver, _batches(1, 2, 64, 1), heldout_batches=_batches(1, 2, 64, 2),
                   spec=FitSpec(alphas=(1e-2,), fallback="mlp", force_mlp=("99.kv",)))


def test_mlp_artifact_round_trip_and_apply_through_chunks(fitted, tmp_path: Path) -> None:
    sender, receiver, mapper = fitted
    assert any(lm.part(p).kind == "mlp" for lm in mapper.layers for p in ("kv", "index")), "fixture needs mlp"
    out = save_mapper(mapper, tmp_path / "m")
    loaded = load_mapper(out)
    assert loaded.digest() == mapper.digest() and loaded.needs_tokens and loaded.needs_receiver_weights
    doc = json.loads((out / "mapper.json").read_text())
    assert doc["format"] == "kvresume.mapper.v2" and doc["calibration"]["task_seeds"] == [5]
    tokens = _batches(1, 1, 48, 9)[0]
    fp_s, fp_r = model_fingerprint(sender), model_fingerprint(receiver)
    with torch.inference_mode():
        state = prefill(sender, tokens).state
        from_state = apply_mapper(loaded, state.clone(), sender_fingerprint=fp_s, receiver_fingerprint=fp_r,
                                  receiver_model=receiver)
        blob = export_global(state, 0, 48, fingerprint=fp_s)
        with pytest.raises(ValueError, match="tokens"):
            apply_mapper(loaded, [blob], sender_fingerprint=fp_s, receiver_fingerprint=fp_r,
                         receiver_model=receiver)
        from_blobs = apply_mapper(loaded, [blob], sender_fingerprint=fp_s, receiver_fingerprint=fp_r,
                                  receiver_model=receiver, tokens=tokens)
    assert from_state.blobs == from_blobs.blobs
    # a damaged mlp array is refused by name
    name = next(k for k in loaded.arrays if ".mlp.w1" in k)
    arrays = dict(loaded.arrays) | {name: loaded.arrays[name][:, 1:].contiguous()}
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        dataclasses.replace(loaded, arrays=arrays)


def test_v1_artifacts_still_load_and_other_formats_are_refused(fitted, tmp_path: Path) -> None:
    sender, receiver, _ = fitted
    with torch.inference_mode():
        ridge = fit_mapper(sender, receiver, _batches(1, 2, 64, 1), heldout_batches=_batches(1, 2, 64, 2),
                           spec=FitSpec(alphas=(1e-2,)))
    out = save_mapper(ridge, tmp_path / "v1")
    doc = json.loads((out / "mapper.json").read_text())
    # what a v1 writer wrote: no calibration, parts without reason/features, a gate without the interval
    doc["format"] = "kvresume.mapper.v1"
    del doc["calibration"]
    del doc["gate"]["min_retention_lower"]
    for layer in doc["layers"]:
        for part in ("kv", "index"):
            del layer[part]["reason"], layer[part]["features"]
    (out / "mapper.json").write_text(json.dumps(doc))
    old = load_mapper(out)
    assert old.calibration == {} and old.gate.min_retention_lower is None and old.fit_task_seeds == ()
    torch.testing.assert_close(old.arrays["layers.2.kv.coef"], ridge.arrays["layers.2.kv.coef"])
    doc["format"] = "kvresume.mapper.v9"
    (out / "mapper.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="kvresume.mapper.v9"):
        load_mapper(out)
