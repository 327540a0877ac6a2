"""Checkpoint I/O: safetensors files in, checked against the model's expected names, shapes and dtypes;
plain checkpoints out; a deterministic weights fingerprint. Knows nothing of the model's layers.

Official quantized tensors load in their storage dtypes: FP8 `float8_e4m3fn`, E8M0 scales
`float8_e8m0fnu`, and FP4 (safetensors dtype F4, header shape [out, in]) as `float4_e2m1fn_x2` [out, in/2],
two codes per byte (safetensors >= 0.8 with torch >= 2.8).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.errors import CheckpointMismatch

__all__ = [
    "SAVEABLE_DTYPES",
    "checkpoint_metadata",
    "load_state_dict",
    "save_state_dict",
    "weights_fingerprint",
]

# Sharded checkpoints (Hugging Face layout) list which file holds each tensor here.
_INDEX_FILE = "model.safetensors.index.json"
# Our own trained checkpoints are unquantized; quantized formats come only from official weights.
SAVEABLE_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool}
)
# Bumped if the fingerprint's byte stream ever changes, so old and new fingerprints never collide.
_FINGERPRINT_DOMAIN = b"kvresume.weights_fingerprint.v1\0"

TensorSpec = tuple[Sequence[int], torch.dtype]


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of a file or directory, plus the names found in more than one file."""
    tensors: dict[str, torch.Tensor] = {}
    duplicated: list[str] = []
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in tensors:
                    duplicated.append(name)
                tensors[name] = f.get_tensor(name)
    return tensors, duplicated


def _expected_specs(
    expected: Mapping[str, TensorSpec] | torch.nn.Module,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if isinstance(expected, torch.nn.Module):
        return {name: (tuple(t.shape), t.dtype) for name, t in expected.state_dict().items()}
    return {name: (tuple(shape), dtype) for name, (shape, dtype) in expected.items()}


def load_state_dict(
    path: str | Path,
    expected: Mapping[str, TensorSpec] | torch.nn.Module,
) -> dict[str, torch.Tensor]:
    """Read a safetensors checkpoint and check it tensor by tensor before returning it.

    Args:
        path: a `.safetensors` file, or a directory holding `model.safetensors.index.json` plus its shards,
            or else any number of `*.safetensors` files.
        expected: name -> (shape, dtype), in torch storage terms (FP4 as `float4_e2m1fn_x2` [out, in/2]),
            or a module whose `state_dict()` gives them.

    Returns:
        name -> CPU tensor in its stored dtype, ready for `module.load_state_dict(sd, strict=True)`.

    Raises:
        FileNotFoundError: no checkpoint file at `path`.
        CheckpointMismatch: any tensor missing, unexpected, duplicated across shards, or of another shape
            or dtype; the message names all of them.
    """
    path = Path(path)
    specs = _expected_specs(expected)
    tensors, duplicated = _read_tensors(path)
    missing = sorted(set(specs) - set(tensors))
    unexpected = sorted(set(tensors) - set(specs))
    mismatched = [f"{name} stored in more than one shard" for name in sorted(set(duplicated))]
    for name in sorted(set(specs) & set(tensors)):
        shape, dtype = specs[name]
        got = tensors[name]
        if tuple(got.shape) != shape or got.dtype != dtype:
            mismatched.append(
                f"{name} is {list(got.shape)} {_dtype_name(got.dtype)}, "
                f"expected {list(shape)} {_dtype_name(dtype)}"
            )
    if missing or unexpected or mismatched:
        raise CheckpointMismatch(
            missing=missing, unexpected=unexpected, mismatched=mismatched, source=str(path)
        )
    return tensors


def checkpoint_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata stored in a safetensors file's header (empty if none)."""
    with Path(path).open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return dict(header.get("__metadata__") or {})


def save_state_dict(
    path: str | Path, state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> None:
    """Write a plain (unquantized) checkpoint atomically: a crash leaves the old file or the new one.

    Args:
        path: the `.safetensors` file to write; its directory must exist.
        state_dict: name -> tensor with a dtype in SAVEABLE_DTYPES (tied tensors are written as copies).
        metadata: string -> string, stored in the file header (e.g. the config JSON, the training run).

    Raises:
        ValueError: a tensor of another dtype, or non-string metadata; every offender is named.
    """
    bad = [f"{n} ({_dtype_name(t.dtype)})" for n, t in state_dict.items() if t.dtype not in SAVEABLE_DTYPES]
    if bad:
        raise ValueError(f"save_state_dict writes plain checkpoints only; these tensors are not: {bad}")
    bad_meta = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad_meta:
        raise ValueError(f"checkpoint metadata must map str to str; bad entries: {bad_meta}")
    seen: set[tuple[int, int]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors sharing memory (tied embeddings); write each one's own copy
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            tensor = tensor.clone()
        seen.add(key)
        tensors[name] = tensor
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=dict(metadata))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def weights_fingerprint(weights: Mapping[str, torch.Tensor] | str | Path) -> str:
    """sha256 hex digest over every tensor's name, dtype, shape and bytes, in name order.

    The same tensors give the same digest whether passed in memory or as a checkpoint path (file order,
    sharding and header metadata do not count). Part of the model fingerprint, which also covers the
    config, the cache format version and the numerics profile.
    """
    if isinstance(weights, str | Path):
        weights, _ = _read_tensors(Path(weights))
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
    for name in sorted(weights):
        tensor = weights[name].detach().to("cpu").contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header = json.dumps([name, _dtype_name(tensor.dtype), list(tensor.shape), len(data)])
        # length-prefix every field so that no two different inputs produce the same byte stream
        encoded = header.encode()
        digest.update(struct.pack("<Q", len(encoded)) + encoded)
        digest.update(data)
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
