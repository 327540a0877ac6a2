"""Checkpoint I/O: the official FP4/FP8 conformance checkpoint, mismatch errors, plain save, fingerprint."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest
import torch

from model import (
    CheckpointMismatch,
    ModelError,
    checkpoint_metadata,
    load_state_dict,
    save_state_dict,
    weights_fingerprint,
)

TINY = Path("/work/shared/conformance/v41-tiny")


def _require_shared() -> None:
    if (TINY / "model.safetensors").exists():
        return
    message = f"{TINY} is absent (the shared conformance vectors)"
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI must have them")
    pytest.skip(message)


def _manifest_specs() -> dict[str, tuple[list[int], torch.dtype]]:
    tensors = json.loads((TINY / "manifest.json").read_text())["files"]["model.safetensors"]["tensors"]
    return {name: (t["shape"], getattr(torch, t["dtype"])) for name, t in tensors.items()}


def _small_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "layers.0.attn.attn_sink": torch.randn(3, generator=g),
        "layers.0.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": torch.tensor(11),
    }


def test_load_state_dict_conformance_checkpoint_dtypes():
    _require_shared()
    sd = load_state_dict(TINY / "model.safetensors", _manifest_specs())
    assert len(sd) == 944
    counts = collections.Counter(str(t.dtype).removeprefix("torch.") for t in sd.values())
    assert counts == {
        "bfloat16": 89, "float32": 101, "float4_e2m1fn_x2": 288, "float8_e4m3fn": 89, "float8_e8m0fnu": 377,
    }
    # FP4 experts: logical [out, in] = [128, 256] stored as [out, in/2] two codes per byte, E8M0 per 32
    w1 = sd["layers.0.ffn.experts.0.w1.weight"]
    assert w1.dtype == torch.float4_e2m1fn_x2 and tuple(w1.shape) == (128, 128)
    assert tuple(sd["layers.0.ffn.experts.0.w1.scale"].shape) == (128, 8)


def test_load_state_dict_conformance_checkpoint_mismatch_names_tensors():
    _require_shared()
    specs = _manifest_specs()
    del specs["head.weight"]
    specs["layers.0.attn.not_there"] = ([4], torch.float32)
    specs["layers.0.ffn.experts.0.w1.weight"] = ([128, 256], torch.float4_e2m1fn_x2)
    specs["embed.weight"] = ([512, 256], torch.float32)
    with pytest.raises(CheckpointMismatch) as info:
        load_state_dict(TINY / "model.safetensors", specs)
    err = info.value
    assert isinstance(err, ModelError)
    assert err.missing == ["layers.0.attn.not_there"] and err.unexpected == ["head.weight"]
    message = str(err)
    assert "layers.0.ffn.experts.0.w1.weight is [128, 128] float4_e2m1fn_x2, expected [128, 256]" in message
    assert "embed.weight is [512, 256] bfloat16, expected [512, 256] float32" in message


def test_save_state_dict_round_trip_and_metadata(tmp_path: Path):
    sd = _small_state_dict()
    path = tmp_path / "model.safetensors"
    save_state_dict(path, sd, {"config": json.dumps({"dim": 5}), "run": "test"})
    loaded = load_state_dict(path, {n: (t.shape, t.dtype) for n, t in sd.items()})
    assert loaded.keys() == sd.keys()
    for name, tensor in sd.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert checkpoint_metadata(path) == {"config": '{"dim": 5}', "run": "test"}
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temp file left behind


def test_load_state_dict_accepts_module(tmp_path: Path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    path = tmp_path / "m.safetensors"
    save_state_dict(path, module.state_dict(), {})
    sd = load_state_dict(path, module)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fresh.load_state_dict(sd, strict=True)
    assert torch.equal(fresh[0].weight, module[0].weight)
    with pytest.raises(CheckpointMismatch, match=r"0\.weight is \[3, 4\] float32, expected \[5, 4\]"):
        load_state_dict(path, torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.LayerNorm(3)))


def test_load_state_dict_sharded_directory(tmp_path: Path):
    sd = _small_state_dict()
    names = sorted(sd)
    save_state_dict(tmp_path / "a.safetensors", {n: sd[n] for n in names[:2]}, {})
    save_state_dict(tmp_path / "b.safetensors", {n: sd[n] for n in names[2:]}, {})
    specs = {n: (t.shape, t.dtype) for n, t in sd.items()}
    assert load_state_dict(tmp_path, specs).keys() == sd.keys()
    index = {"weight_map": {n: "a.safetensors" if n in names[:2] else "b.safetensors" for n in names}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index lists the shards")
    assert load_state_dict(tmp_path, specs).keys() == sd.keys()


def test_load_state_dict_duplicate_across_shards(tmp_path: Path):
    sd = _small_state_dict()
    save_state_dict(tmp_path / "a.safetensors", sd, {})
    save_state_dict(tmp_path / "b.safetensors", {"step": sd["step"]}, {})
    with pytest.raises(CheckpointMismatch, match="step stored in more than one shard"):
        load_state_dict(tmp_path, {n: (t.shape, t.dtype) for n, t in sd.items()})


def test_load_state_dict_no_checkpoint(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        load_state_dict(tmp_path / "absent.safetensors", {})
    with pytest.raises(FileNotFoundError):
        load_state_dict(tmp_path, {})


def test_save_state_dict_rejects_quantized_and_bad_metadata(tmp_path: Path):
    fp8 = {"w": torch.zeros(2, 2).to(torch.float8_e4m3fn), "ok": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"w \(float8_e4m3fn\)"):
        save_state_dict(tmp_path / "x.safetensors", fp8, {})
    with pytest.raises(ValueError, match="dim"):
        save_state_dict(tmp_path / "x.safetensors", {"ok": torch.zeros(2)}, {"dim": 5})  # type: ignore[dict-item]
    assert not list(tmp_path.iterdir())


def test_save_state_dict_tied_tensors(tmp_path: Path):
    shared = torch.randn(4, 3)
    path = tmp_path / "tied.safetensors"
    save_state_dict(path, {"embed.weight": shared, "head.weight": shared}, {})
    spec = ((4, 3), torch.float32)
    sd = load_state_dict(path, {"embed.weight": spec, "head.weight": spec})
    assert torch.equal(sd["embed.weight"], shared) and torch.equal(sd["head.weight"], shared)


def test_weights_fingerprint_deterministic_and_sensitive(tmp_path: Path):
    sd = _small_state_dict()
    base = weights_fingerprint(sd)
    assert base == weights_fingerprint(dict(reversed(list(sd.items()))))
    assert base == weights_fingerprint(_small_state_dict())
    path = tmp_path / "m.safetensors"
    save_state_dict(path, sd, {"anything": "metadata does not count"})
    assert weights_fingerprint(path) == base
    assert len(base) == 64 and int(base, 16) >= 0

    flipped = dict(sd)
    bits = sd["layers.0.attn.attn_sink"].clone().view(torch.int32)
    bits[1] ^= 1  # one low mantissa bit
    flipped["layers.0.attn.attn_sink"] = bits.view(torch.float32)
    renamed = {("embed.w" if n == "embed.weight" else n): t for n, t in sd.items()}
    reshaped = dict(sd) | {"embed.weight": sd["embed.weight"].reshape(5, 7)}
    retyped = dict(sd) | {"embed.weight": sd["embed.weight"].view(torch.float16)}
    dropped = {n: t for n, t in sd.items() if n != "step"}
    variants = [flipped, renamed, reshaped, retyped, dropped]
    digests = {weights_fingerprint(v) for v in variants}
    assert base not in digests and len(digests) == len(variants)


def test_weights_fingerprint_conformance_file_equals_loaded():
    _require_shared()
    path = TINY / "model.safetensors"
    sd = load_state_dict(path, _manifest_specs())
    assert weights_fingerprint(path) == weights_fingerprint(sd)
