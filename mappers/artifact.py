"""The mapper artifact: per receiver kv-source layer, which sender layers feed it and the linear maps of
its main KV and index keys, plus the pair's identity, quality figures and gate; saved as safetensors
arrays and a JSON document (never a pickle). Knows nothing of how maps are fitted or applied.

Directory layout: `mapper.json` (format `kvresume.mapper.v2`, strict keys) and `weights.safetensors`
(fp32 arrays `layers.{r}.{part}.coef` [D_out, k*D_in] and `layers.{r}.{part}.intercept` [D_out], part
"kv" or "index", present for linear and mlp parts; an mlp part adds `layers.{r}.{part}.mlp.{mu, sigma, w1,
b1, w2, b2}`, see mappers/mlp.py). v2 adds per part `reason` (why this map) and `features` (mlp parts),
and `calibration` (the seeds and corpus the fit read). v1 artifacts still load (no mlp parts, empty
reasons and calibration); any other format is refused naming it. A loaded artifact is validated against
the two configs it carries; the JSON records the weights' sha256 so a swapped or damaged weights file is
rejected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mappers.geometry import source_of, sources_of
from mappers.mlp import MLP_ARRAYS, MlpFeatures
from model import ModelConfig

MAPPER_FORMAT = "kvresume.mapper.v2"
# formats `load_mapper` reads: v1 (ridge/identity/recompute parts, no reasons or calibration) and v2
MAPPER_FORMATS = ("kvresume.mapper.v1", MAPPER_FORMAT)
MAPPER_JSON = "mapper.json"
MAPPER_WEIGHTS = "weights.safetensors"
# "recompute" (index part only): index K = the receiver's own k_norm(wk(mapped pre-RoPE latent)), the
# V4.1 relation index-K = f(latent) (V41_SPEC §4.1, MAPPING §4.2.3); needs the receiver's weights.
# "mlp": the linear map plus a residual MLP on context features (mappers/mlp.py), the fallback for parts
# whose ridge fails the part gate.
MAP_KINDS = ("identity", "linear", "recompute", "mlp")
PARTS = ("kv", "index")
# Keys (main KV and index K) are fitted and applied in content space: the sender's entry rotation is
# stripped, the map applied, the receiver's rotation applied. The only mode in v1.
ROPE_MODES = ("strip_apply",)


def _check_keys(where: str, data: Any, required: set[str], optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - required - optional)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """One side of the pair: a display name, the model fingerprint (hex of `model.model_fingerprint`, or
    None for a mapper bound to configs only, such as an identity map) and the full config."""

    name: str
    fingerprint: str | None
    config: ModelConfig

    def __post_init__(self) -> None:
        if self.fingerprint is not None:
            fp = self.fingerprint
            if len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp):
                raise ValueError(f"fingerprint must be 64 lowercase hex digits, got {fp!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "fingerprint": self.fingerprint, "config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, where: str, data: Any) -> ModelRef:
        _check_keys(where, data, {"name", "fingerprint", "config"})
        try:
            config = ModelConfig.from_dict(data["config"])
        except ValueError as exc:
            raise ValueError(f"{where}.config: {exc}") from exc
        return cls(name=str(data["name"]), fingerprint=data["fingerprint"], config=config)


@dataclass(frozen=True, kw_only=True)
class PartMap:
    """The map of one part (main KV or index K) of one receiver source.

    Attributes:
        kind: "identity" (one sender layer of the same width, no arrays), "linear" (coef + intercept),
            or "recompute" (index part only: from the mapped main KV with the receiver's own indexer
            weights; no arrays).
        sender_layers: sender kv-source layers stacked along the input, ascending (for "recompute",
            those of the main-KV part it derives from).
        alpha: the absolute ridge penalty the fit used (None for identity).
        reason: why the fit chose this map (e.g. the part gate's figures); empty in v1 artifacts.
        features: the context an "mlp" part reads (None otherwise).
    """

    kind: str
    sender_layers: tuple[int, ...]
    alpha: float | None = None
    reason: str = ""
    features: MlpFeatures | None = None

    def __post_init__(self) -> None:
        if self.kind not in MAP_KINDS:
            raise ValueError(f"map kind must be one of {MAP_KINDS}, got {self.kind!r}")
        layers = tuple(int(s) for s in self.sender_layers)
        object.__setattr__(self, "sender_layers", layers)
        if not layers or list(layers) != sorted(set(layers)):
            raise ValueError(f"sender_layers must be non-empty and strictly ascending, got {list(layers)}")
        if self.kind == "identity" and len(layers) != 1:
            raise ValueError(f"an identity map reads exactly one sender layer, got {list(layers)}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {self.alpha}")
        if (self.kind == "mlp") != (self.features is not None):
            raise ValueError(f"features are given exactly for mlp parts (kind {self.kind!r})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "sender_layers": list(self.sender_layers), "alpha": self.alpha,
            "reason": self.reason, "features": self.features.to_dict() if self.features else None,
        }

    @classmethod
    def from_dict(cls, where: str, data: Any) -> PartMap:
        _check_keys(where, data, {"kind", "sender_layers", "alpha"}, frozenset({"reason", "features"}))
        try:
            features = data.get("features")
            return cls(
                kind=data["kind"], sender_layers=tuple(data["sender_layers"]), alpha=data["alpha"],
                reason=str(data.get("reason", "")),
                features=MlpFeatures.from_dict(f"{where}.features", features) if features else None,
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class LayerMap:
    """Everything that maps into receiver kv-source `receiver_layer` (compression ratio `ratio`)."""

    receiver_layer: int
    ratio: int
    kv: PartMap
    index: PartMap
    rope: str = "strip_apply"
    quality: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rope not in ROPE_MODES:
            raise ValueError(f"rope mode must be one of {ROPE_MODES}, got {self.rope!r}")

    def part(self, name: str) -> PartMap:
        if name not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {name!r}")
        return self.kv if name == "kv" else self.index

    def to_dict(self) -> dict[str, Any]:
        return {
            "receiver_layer": self.receiver_layer,
            "ratio": self.ratio,
            "rope": self.rope,
            "kv": self.kv.to_dict(),
            "index": self.index.to_dict(),
            "quality": dict(self.quality),
        }

    @classmethod
    def from_dict(cls, where: str, data: Any) -> LayerMap:
        _check_keys(where, data, {"receiver_layer", "ratio", "rope", "kv", "index", "quality"})
        return cls(
            receiver_layer=int(data["receiver_layer"]),
            ratio=int(data["ratio"]),
            rope=data["rope"],
            kv=PartMap.from_dict(f"{where}.kv", data["kv"]),
            index=PartMap.from_dict(f"{where}.index", data["index"]),
            quality={str(k): float(v) for k, v in dict(data["quality"]).items()},
        )


@dataclass(frozen=True, kw_only=True)
class GateSpec:
    """Thresholds a mapper must meet on held-out text to be used (None: not gated on that figure).

    min_attn_cosine applies to the mean over layers of the attention-output cosine against the receiver's
    own global KV after the same bounded replay (the mapping's error alone), max_next_token_kl to the mean
    next-token KL against the receiver's own cold cache (replay and mapping together), min_index_recall
    to the mean index top-k recall, min_retention to the measured task retention (mapped accuracy / own
    accuracy) when an evaluation supplies one, min_retention_lower to the lower end of its 95% paired
    bootstrap interval (`retention_ci_lower`: the smallest over the distance buckets measured).

    The retention interval is the gate: with the default min_retention_lower a mapper passes only when task
    retention was measured and its lower bound reaches 0.80 (issue 12; the target point estimate is 0.90).
    Cosine, KL and index recall are screens: they can reject, they cannot accept on their own.
    """

    min_attn_cosine: float | None = 0.9
    max_next_token_kl: float | None = 0.2
    min_index_recall: float | None = 0.5
    min_retention: float | None = None
    min_retention_lower: float | None = 0.8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"gate {f.name} must be finite or None, got {v}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, where: str, data: Any) -> GateSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        _check_keys(where, data, set(), frozenset(names))
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class KVMapper:
    """A cross-model KV mapper from `sender` to `receiver`: one LayerMap per receiver kv source.

    Attributes:
        arrays: name -> fp32 tensor, see the module docstring (linear parts only).
        quality: pair-level figures (e.g. attn_cosine_mean, next_token_kl, index_recall, r2_kv_mean).
        passed_gate: whether `quality` met `gate` when last evaluated.
        calibration: what the fit read: corpus, calibration seeds, task seeds of any episodes (so an
            evaluation can refuse episodes the fit saw); empty for v1 artifacts.
    """

    sender: ModelRef
    receiver: ModelRef
    layers: tuple[LayerMap, ...]
    arrays: Mapping[str, torch.Tensor] = field(default_factory=dict)
    gate: GateSpec = field(default_factory=GateSpec)
    quality: Mapping[str, float] = field(default_factory=dict)
    passed_gate: bool = False
    calibration: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def fit_task_seeds(self) -> tuple[int, ...]:
        """Task seeds whose episodes the fit read or was gated on (`mapper eval` refuses them)."""
        return tuple(int(s) for s in self.calibration.get("task_seeds", ()))

    def layer(self, receiver_layer: int) -> LayerMap:
        """The LayerMap of receiver kv source `receiver_layer`.

        Raises:
            ValueError: no such receiver source.
        """
        for lm in self.layers:
            if lm.receiver_layer == receiver_layer:
                return lm
        raise ValueError(f"no map for receiver layer {receiver_layer}")

    @property
    def needs_receiver_weights(self) -> bool:
        """Whether `apply_mapper` needs the receiver model (an index part of kind "recompute", or an mlp
        part reading the receiver's token embeddings)."""
        return self.needs_tokens or any(lm.index.kind == "recompute" for lm in self.layers)

    @property
    def needs_tokens(self) -> bool:
        """Whether `apply_mapper` needs the history's tokens (an mlp part reading token embeddings)."""
        return any(
            pm.kind == "mlp" and pm.features is not None and pm.features.embed
            for lm in self.layers for pm in (lm.kv, lm.index)
        )

    def mlp_arrays(self, receiver_layer: int, part: str) -> dict[str, torch.Tensor]:
        """coef, intercept and the MLP arrays of an mlp part (the names `mappers.mlp` reads)."""
        pre = f"layers.{receiver_layer}.{part}"
        coef, intercept = self.weights(receiver_layer, part)
        return {"coef": coef, "intercept": intercept} | {k: self.arrays[f"{pre}.mlp.{k}"] for k in MLP_ARRAYS}

    def weights(self, receiver_layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor]:
        """coef [D_out, k*D_in] fp32 and intercept [D_out] fp32 of a linear part."""
        return (
            self.arrays[f"layers.{receiver_layer}.{part}.coef"],
            self.arrays[f"layers.{receiver_layer}.{part}.intercept"],
        )

    def validate(self) -> None:
        """Check layers and array shapes against both configs.

        Raises:
            ValueError: naming the bad field (layer, part, array name, shape).
        """
        s_cfg, r_cfg = self.sender.config, self.receiver.config
        wanted = [src.layer for src in sources_of(r_cfg)]
        got = [lm.receiver_layer for lm in self.layers]
        if got != wanted:
            raise ValueError(f"layers: receiver layers {got} must be the receiver's kv sources {wanted}")
        expected: dict[str, tuple[int, ...]] = {}
        for lm in self.layers:
            r_src = source_of(r_cfg, lm.receiver_layer)
            if lm.ratio != r_src.ratio:
                raise ValueError(
                    f"layers[{lm.receiver_layer}].ratio is {lm.ratio}, the receiver's layer has {r_src.ratio}"
                )
            for part in PARTS:
                pm = lm.part(part)
                where = f"layers[{lm.receiver_layer}].{part}"
                widths = []
                for s in pm.sender_layers:
                    try:
                        s_src = source_of(s_cfg, s)
                    except ValueError as exc:
                        raise ValueError(f"{where}.sender_layers: {exc}") from exc
                    if s_src.ratio != lm.ratio:
                        raise ValueError(
                            f"{where}.sender_layers: sender layer {s} has ratio {s_src.ratio}, "
                            f"not {lm.ratio}"
                        )
                    widths.append(s_src.head_dim if part == "kv" else s_src.index_head_dim)
                d_out = r_src.head_dim if part == "kv" else r_src.index_head_dim
                if pm.kind == "recompute":
                    if part != "index" or pm.sender_layers != lm.kv.sender_layers:
                        raise ValueError(
                            f"{where}: recompute is for the index part and reads the kv part's sender layers"
                        )
                elif pm.kind == "identity":
                    if widths[0] != d_out:
                        raise ValueError(
                            f"{where}: identity needs equal widths, sender {widths[0]} vs receiver {d_out}"
                        )
                else:
                    expected[f"layers.{lm.receiver_layer}.{part}.coef"] = (d_out, sum(widths))
                    expected[f"layers.{lm.receiver_layer}.{part}.intercept"] = (d_out,)
                if pm.kind == "mlp":
                    expected |= self._mlp_shapes(lm, part, pm, sum(widths), d_out, where)
        extra = sorted(set(self.arrays) - set(expected))
        if extra:
            raise ValueError(f"arrays: unexpected arrays {extra}")
        for name, shape in expected.items():
            if name not in self.arrays:
                raise ValueError(f"arrays: missing {name} (shape {list(shape)})")
            t = self.arrays[name]
            if tuple(t.shape) != shape or t.dtype != torch.float32:
                raise ValueError(
                    f"arrays: {name} is {t.dtype} {list(t.shape)}, expected torch.float32 {list(shape)}"
                )
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"arrays: {name} holds non-finite values")

    def _mlp_shapes(self, lm: LayerMap, part: str, pm: PartMap, w_in: int, d_out: int, where: str):
        s_cfg, r_cfg = self.sender.config, self.receiver.config
        feats = pm.features
        assert feats is not None
        width = (feats.context + 1) * w_in
        for s in feats.other_layers:
            try:
                o = source_of(s_cfg, s)
            except ValueError as exc:
                raise ValueError(f"{where}.features.other_layers: {exc}") from exc
            if o.ratio == lm.ratio:
                raise ValueError(f"{where}.features.other_layers: layer {s} has the part's ratio {o.ratio}")
            width += o.head_dim
        width += r_cfg.dim if feats.embed else 0
        pre = f"layers.{lm.receiver_layer}.{part}.mlp"
        h = feats.hidden
        return {f"{pre}.mu": (width,), f"{pre}.sigma": (width,), f"{pre}.w1": (h, width), f"{pre}.b1": (h,),
                f"{pre}.w2": (d_out, h), f"{pre}.b2": (d_out,)}

    def metadata(self) -> dict[str, Any]:
        """The JSON document (without the weights digest)."""
        return {
            "format": MAPPER_FORMAT,
            "calibration": dict(self.calibration),
            "sender": self.sender.to_dict(),
            "receiver": self.receiver.to_dict(),
            "layers": [lm.to_dict() for lm in self.layers],
            "gate": self.gate.to_dict(),
            "quality": dict(self.quality),
            "passed_gate": self.passed_gate,
        }

    def digest(self) -> str:
        """sha256 hex over the metadata and the arrays: a stable id for a registry row."""
        h = hashlib.sha256(json.dumps(self.metadata(), sort_keys=True).encode())
        for name in sorted(self.arrays):
            h.update(name.encode() + b"\0")
            h.update(self.arrays[name].contiguous().numpy().tobytes())
        return h.hexdigest()


def save_mapper(mapper: KVMapper, directory: str | Path) -> Path:
    """Write `mapper.json` and `weights.safetensors` into `directory` (created if needed).

    The weights are written first and the JSON last, each through a temporary name, so a crash leaves
    either no `mapper.json` or a complete artifact.

    Returns:
        the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp_weights = directory / (MAPPER_WEIGHTS + ".tmp")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in mapper.arrays.items()}
    save_file(tensors, str(tmp_weights), metadata={"format": MAPPER_FORMAT})
    weights_sha = hashlib.sha256(tmp_weights.read_bytes()).hexdigest()
    tmp_weights.replace(directory / MAPPER_WEIGHTS)
    doc = mapper.metadata() | {"weights_sha256": weights_sha}
    tmp_json = directory / (MAPPER_JSON + ".tmp")
    tmp_json.write_text(json.dumps(doc, indent=2, sort_keys=True))
    tmp_json.replace(directory / MAPPER_JSON)
    return directory


def read_metadata(directory: str | Path) -> dict[str, Any]:
    """The raw JSON document of an artifact (for listings that do not need the weights).

    Raises:
        FileNotFoundError: no mapper.json; ValueError: not JSON or another format.
    """
    path = Path(directory) / MAPPER_JSON
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") not in MAPPER_FORMATS:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise ValueError(f"{path}: format is {got!r}, this version reads {list(MAPPER_FORMATS)}")
    return doc


def _v1_gate(gate: Any) -> Any:
    return {"min_retention_lower": None} | gate if isinstance(gate, dict) else gate


def load_mapper(directory: str | Path) -> KVMapper:
    """Read and validate an artifact written by `save_mapper`.

    Raises:
        FileNotFoundError: a missing file.
        ValueError: naming the bad field: unknown or missing keys, a weights digest mismatch, layers or
            array shapes that do not fit the two configs.
    """
    directory = Path(directory)
    doc = read_metadata(directory)
    top = {"format", "sender", "receiver", "layers", "gate", "quality", "passed_gate", "weights_sha256"}
    # v1 has no calibration record; v2 always writes one
    v2 = doc["format"] == MAPPER_FORMAT
    _check_keys(str(directory / MAPPER_JSON), doc, top | ({"calibration"} if v2 else set()))
    if not isinstance(doc.get("calibration", {}), dict):
        raise ValueError("calibration must be a JSON object")
    weights_path = directory / MAPPER_WEIGHTS
    raw = weights_path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != doc["weights_sha256"]:
        raise ValueError(f"weights_sha256: {weights_path} does not match the digest in {MAPPER_JSON}")
    arrays = load_file(str(weights_path))
    if not isinstance(doc["layers"], list):
        raise ValueError("layers must be a JSON list")
    if not isinstance(doc["passed_gate"], bool):
        raise ValueError(f"passed_gate must be true or false, got {doc['passed_gate']!r}")
    return KVMapper(
        sender=ModelRef.from_dict("sender", doc["sender"]),
        receiver=ModelRef.from_dict("receiver", doc["receiver"]),
        layers=tuple(LayerMap.from_dict(f"layers[{i}]", d) for i, d in enumerate(doc["layers"])),
        arrays=arrays,
        # a v1 gate had no interval knob: it loads as recorded, not with today's default
        gate=GateSpec.from_dict("gate", _v1_gate(doc["gate"]) if not v2 else doc["gate"]),
        quality={str(k): float(v) for k, v in dict(doc["quality"]).items()},
        passed_gate=doc["passed_gate"],
        calibration=dict(doc.get("calibration", {})),
    )
