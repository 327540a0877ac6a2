"""save_mapper / load_mapper: round trip of arrays and metadata, and validation naming the bad field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mappers import (
    GateSpec,
    KVMapper,
    PartMap,
    identity_mapper,
    load_mapper,
    read_metadata,
    save_mapper,
)
from model import load_preset


def _linear_mapper(seed: int = 0) -> KVMapper:
    """A v41-tiny -> narrower-index receiver mapper with random linear parts (ratio-2 layers stacked)."""
    s_cfg = load_preset("v41-tiny")
    r_cfg = dataclasses.replace(s_cfg, head_dim=64, rope_head_dim=16, index_head_dim=32, dim=128)
    base = identity_mapper(s_cfg, s_cfg, sender_name="tiny-a", receiver_name="tiny-b")
    g = torch.Generator().manual_seed(seed)
    layers, arrays = [], {}
    for lm in base.layers:
        senders = (2, 4) if lm.ratio == 2 else (6,)
        lm = dataclasses.replace(
            lm,
            kv=PartMap(kind="linear", sender_layers=senders, alpha=0.5),
            index=PartMap(kind="linear", sender_layers=senders[-1:], alpha=0.25),
            quality={"r2_kv": 0.5},
        )
        layers.append(lm)
        r = lm.receiver_layer
        arrays[f"layers.{r}.kv.coef"] = torch.randn(64, 128 * len(senders), generator=g)
        arrays[f"layers.{r}.kv.intercept"] = torch.randn(64, generator=g)
        arrays[f"layers.{r}.index.coef"] = torch.randn(32, 64, generator=g)
        arrays[f"layers.{r}.index.intercept"] = torch.randn(32, generator=g)
    return KVMapper(
        sender=dataclasses.replace(base.sender, fingerprint="ab" * 32),
        receiver=dataclasses.replace(base.receiver, config=r_cfg),
        layers=tuple(layers),
        arrays=arrays,
        gate=GateSpec(min_attn_cosine=0.8),
        quality={"attn_cosine_mean": 0.91},
        passed_gate=True,
    )


def test_save_mapper_load_mapper_round_trip(tmp_path: Path) -> None:
    mapper = _linear_mapper()
    save_mapper(mapper, tmp_path / "m")
    back = load_mapper(tmp_path / "m")
    assert back.metadata() == mapper.metadata()
    assert set(back.arrays) == set(mapper.arrays)
    for name, t in mapper.arrays.items():
        assert torch.equal(back.arrays[name], t), name
    assert back.digest() == mapper.digest()
    assert back.sender.fingerprint == "ab" * 32 and back.receiver.fingerprint is None
    assert back.layer(2).kv.sender_layers == (2, 4)
    assert read_metadata(tmp_path / "m")["passed_gate"] is True
    # the identity mapper has no arrays and round-trips too
    ident = identity_mapper(load_preset("v41-tiny"), load_preset("v41-tiny"))
    save_mapper(ident, tmp_path / "i")
    assert load_mapper(tmp_path / "i").metadata() == ident.metadata()


def _rewrite(path: Path, edit) -> None:
    doc = json.loads((path / "mapper.json").read_text())
    edit(doc)
    (path / "mapper.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
        (lambda d: d["layers"][0].update(ratio=1), r"layers\[2\]\.ratio is 1"),
        (lambda d: d["layers"][0]["kv"].update(sender_layers=[2, 6]), r"sender layer 6 has ratio 1"),
        (lambda d: d["layers"][0]["kv"].update(sender_layers=[3]), r"layers\[2\]\.kv\.sender_layers"),
        (lambda d: d["layers"][0]["kv"].update(sender_layers=[2]), r"layers\.2\.kv\.coef is .* expected"),
        (lambda d: d["layers"][1]["index"].update(kind="identity"), r"identity needs equal widths"),
        (lambda d: d["layers"][1]["kv"].update(kind="recompute"), r"layers\[4\]\.kv: recompute is for"),
        (lambda d: d["layers"].pop(), r"receiver layers \[2, 4\] must be"),
        (lambda d: d["sender"].update(fingerprint="xyz"), "fingerprint must be 64"),
        (lambda d: d["receiver"]["config"].update(n_layers=-1), r"receiver\.config"),
        (lambda d: d.update(weights_sha256="0" * 64), "weights_sha256"),
        (lambda d: d["gate"].update(min_kl=1.0), r"gate: unknown keys"),
        (lambda d: d.update(format="other"), "format is 'other'"),
    ],
    ids=[
        "extra-key", "ratio", "sender-ratio", "not-a-source", "coef-shape", "identity-width", "recompute-kv",
        "missing-layer", "fingerprint", "config", "digest", "gate-key", "format",
    ],  # fmt: skip
)
def test_load_mapper_names_the_bad_field(tmp_path: Path, edit, message: str) -> None:
    save_mapper(_linear_mapper(), tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_mapper(tmp_path)


def test_kvmapper_rejects_bad_arrays() -> None:
    mapper = _linear_mapper()
    arrays = dict(mapper.arrays)
    arrays["layers.2.kv.coef"] = arrays["layers.2.kv.coef"].double()
    with pytest.raises(ValueError, match="layers.2.kv.coef is torch.float64"):
        dataclasses.replace(mapper, arrays=arrays)
    arrays = dict(mapper.arrays)
    arrays["layers.4.index.intercept"] = torch.full((32,), float("nan"))
    with pytest.raises(ValueError, match="layers.4.index.intercept holds non-finite"):
        dataclasses.replace(mapper, arrays=arrays)
    arrays = dict(mapper.arrays) | {"layers.9.kv.coef": torch.zeros(1)}
    with pytest.raises(ValueError, match="unexpected arrays"):
        dataclasses.replace(mapper, arrays=arrays)
    with pytest.raises(ValueError, match="strictly ascending"):
        PartMap(kind="linear", sender_layers=(4, 2))
