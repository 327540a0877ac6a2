"""ServedModelSpec.parse, default_model_specs (checkpoints when present), ModelRegistry, text codecs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model import load_preset
from orchestrator.engine import (
    DEFAULT_SIBLINGS,
    ByteCodec,
    ModelRegistry,
    ServedModelSpec,
    choose_codec,
    default_model_specs,
)


def test_served_model_spec_parse() -> None:
    assert ServedModelSpec.parse("m", "checkpoint:/x/y").checkpoint == Path("/x/y")
    spec = ServedModelSpec.parse("m", "random:v41-tiny@7")
    assert (spec.config, spec.seed, spec.is_stand_in) == ("v41-tiny", 7, True)
    assert ServedModelSpec.parse("m", "random:/a/config.json").seed == 0
    for bad in ("v41-tiny", "random:", "random:v41-tiny@x", "weights:/x"):
        with pytest.raises(ValueError, match="m"):
            ServedModelSpec.parse("m", bad)


def test_default_model_specs_switch_to_shipped_checkpoints(tmp_path: Path) -> None:
    stand_ins = default_model_specs(tmp_path)
    assert list(stand_ins) == list(DEFAULT_SIBLINGS)
    assert all(s.is_stand_in for s in stand_ins.values())
    ckpt = tmp_path / "checkpoints" / DEFAULT_SIBLINGS[0]
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(load_preset("v41-tiny").to_dict()))
    specs = default_model_specs(tmp_path)
    assert specs[DEFAULT_SIBLINGS[0]].checkpoint == ckpt
    assert specs[DEFAULT_SIBLINGS[1]].is_stand_in


def test_model_registry_loads_once_and_misses_unknown() -> None:
    reg = ModelRegistry.from_sources({"x": "random:v41-tiny@3"})
    assert reg.get("nope") is None
    served = reg.get("x")
    assert served is reg.get("x")
    assert len(served.fingerprint) == 32 and served.geometry.window == 32 and served.geometry.group == 2
    other = ModelRegistry.from_sources({"x": "random:v41-tiny@4"}).get("x")
    assert other.fingerprint != served.fingerprint


def test_choose_codec(tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[3] / "checkpoints" / "tokenizer" / "tokenizer.json"
    codec = choose_codec(512, [shipped])
    assert isinstance(codec, ByteCodec)
    assert codec.decode(codec.encode("héllo <key>")) == "héllo <key>"
    if shipped.is_file():
        bpe = choose_codec(1 << 16, [shipped])
        assert (
            bpe.name.startswith("bpe:")
            and bpe.decode(bpe.encode("def f(x): return x")) == "def f(x): return x"
        )
    with pytest.raises(ValueError, match="vocab_size=100"):
        choose_codec(100, [])
