"""The models this node serves: a name -> source table (a checkpoint directory, or a seeded random-init
stand-in of a config), loaded lazily, each with its fingerprint, replay geometry, tokenizer and lock.

Knows nothing of sessions or storage. Source strings (settings `served_models`, TOML or env):
`checkpoint:<dir>` (config.json + model.safetensors) or `random:<preset name | config.json path>[@seed]`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import prepare_sparse_attn
from model import (
    KERNEL_BACKENDS,
    MATH_MODES,
    ModelConfig,
    NumericsProfile,
    Transformer,
    init_random,
    load_model,
    load_preset,
    model_fingerprint,
    set_linear_math,
)
from orchestrator.engine.text_codec import TextCodec, choose_codec
from orchestrator.numerics_env import (
    CPU_PATH_CHOICES,
    PINNED_ENVS,
    in_force_problems,
    native_host_id,
    resolve_cpu_path,
)
from orchestrator.planner import ModelGeometry

__all__ = [
    "DEFAULT_SIBLINGS",
    "ServedModel",
    "ServedModelSpec",
    "ModelRegistry",
    "default_model_specs",
    "repo_root",
]

# The sibling family the training helper ships under checkpoints/<name>/; until every sibling's checkpoint
# exists, each is served by a seeded random-init stand-in of the v41-tiny preset (seed = position + 1).
DEFAULT_SIBLINGS: tuple[str, ...] = ("v41-sib-s", "v41-sib-l")
STAND_IN_PRESET = "v41-tiny"
# Transformer's kernel backends (model/transformer.py checks them again when a model is built); checked
# here too because models load lazily, so a bad setting would otherwise surface on the first turn.


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True)
class ServedModelSpec:
    """Where one served model's weights come from.

    Attributes:
        name: the model name callers use (CreateSession.model, TurnRequest.model).
        checkpoint: a directory with config.json and model.safetensors (real weights).
        config: for a random-init stand-in: a preset name or a config.json path.
        seed: the stand-in's init seed.
    """

    name: str
    checkpoint: Path | None = None
    config: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("served model name must be non-empty")
        if (self.checkpoint is None) == (self.config is None):
            raise ValueError(f"served model {self.name!r} needs exactly one of checkpoint or config")

    @classmethod
    def parse(cls, name: str, source: str) -> ServedModelSpec:
        """`checkpoint:<dir>` or `random:<preset | config.json>[@seed]`.

        Raises:
            ValueError: another form.
        """
        kind, sep, rest = source.partition(":")
        if sep and kind == "checkpoint" and rest:
            return cls(name=name, checkpoint=Path(rest))
        if sep and kind == "random" and rest:
            config, at, seed = rest.rpartition("@") if "@" in rest else (rest, "", "0")
            try:
                return cls(name=name, config=config, seed=int(seed))
            except ValueError as exc:
                raise ValueError(f"served model {name!r}: bad seed in {source!r}") from exc
        raise ValueError(
            f"served model {name!r}: source {source!r} must be checkpoint:<dir> or random:<config>[@seed]"
        )

    @property
    def source(self) -> str:
        if self.checkpoint is not None:
            return f"checkpoint:{self.checkpoint}"
        return f"random:{self.config}@{self.seed}"

    @property
    def is_stand_in(self) -> bool:
        return self.checkpoint is None


def default_model_specs(root: Path | None = None) -> dict[str, ServedModelSpec]:
    """The family siblings: the shipped checkpoints when all are present, else labelled random-init
    stand-ins for all of them.

    Never a mix: a trained sibling's vocabulary and tokenizer are not the stand-in's, so a session could
    not switch between them (its history would hold ids outside the other's vocabulary).
    """
    base = (root or repo_root()) / "checkpoints"
    ckpts = {name: base / name for name in DEFAULT_SIBLINGS}
    if all((ckpt / "config.json").is_file() for ckpt in ckpts.values()):
        return {name: ServedModelSpec(name=name, checkpoint=ckpt) for name, ckpt in ckpts.items()}
    return {
        name: ServedModelSpec(name=name, config=STAND_IN_PRESET, seed=i + 1)
        for i, name in enumerate(DEFAULT_SIBLINGS)
    }


def _config_of(spec: ServedModelSpec) -> ModelConfig:
    assert spec.config is not None
    if spec.config.endswith(".json"):
        return ModelConfig.from_json(spec.config)
    return load_preset(spec.config)


def _group(cfg: ModelConfig) -> int:
    return math.lcm(*[r for r in cfg.compress_ratios[: cfg.n_layers] if r > 0] or [1])


@dataclass(kw_only=True, eq=False)
class ServedModel:
    """A loaded model. `lock` serialises its forward passes (one pass at a time per model; sessions
    interleave between passes). `fingerprint_hex` is the store's model id; it covers `numerics`.

    Weights released (`weights_held` False: a node whose models compute in a model process of their own,
    `load_served(hold_weights=False)`): `model` keeps its config but no weights (meta tensors), and what
    this process needs of the weights was computed before they went (the fingerprint,
    `pinned_alternates`). `weights()` loads them again, once, for the rare caller that reads them here.
    """

    spec: ServedModelSpec
    model: Transformer
    fingerprint: bytes
    numerics: NumericsProfile
    codec: TextCodec
    lock: threading.Lock = field(default_factory=threading.Lock)
    # where the weights live (or lived, when released), as the registry chose
    device: str = "cpu"
    weights_held: bool = True
    # hex fingerprints of these weights under the other pinned CPU path (`pinned_alternates`), computed
    # here when the weights are released; None: compute them from `model` when asked
    pinned_alternates: frozenset[str] | None = None
    _reloaded: Transformer | None = field(default=None, repr=False)

    def alternate_fingerprints(self) -> frozenset[str]:
        """`pinned_alternates` of these weights: kept from before they were released, or computed now."""
        if self.pinned_alternates is not None:
            return self.pinned_alternates
        return pinned_alternates(self.model, self.numerics)

    def weights(self) -> Transformer:
        """The model with its weights: `model`, or, when this process released them, a copy loaded on
        `device` at the first call and kept (a mapper that reads the receiver's weights, applied here)."""
        if self.weights_held:
            return self.model
        with self.lock:
            if self._reloaded is None:
                self._reloaded = _load_weights(self.spec, self.device, self.model.kernel_backend)
                set_linear_math(self._reloaded, self.numerics.math)
            return self._reloaded

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def geometry(self) -> ModelGeometry:
        cfg = self.model.cfg
        return ModelGeometry(window=cfg.window_size, group=_group(cfg))


def load_served(
    spec: ServedModelSpec,
    *,
    device: str = "cpu",
    kernel_backend: str = "torch",
    cpu_path: str = "auto",
    linear_math: str = "exact",
    hold_weights: bool = True,
) -> ServedModel:
    """Load weights (or init the stand-in), fingerprint them under the numerics profile, and pick the
    tokenizer.

    Args:
        device: where the model runs.
        kernel_backend: the model's kernels, "torch" or "triton" (Transformer's `kernel_backend`).
        cpu_path: the CPU code path ("portable", "strict", "native", or "auto" for what
            `numerics_env.resolve_cpu_path` picks), which must be in force in this process: a
            fingerprint that named a profile the process does not compute with would let caches of
            another arithmetic hit.
        linear_math: the quantized linears' math, "exact" or "fast" (`model.set_linear_math`); named in the
            numerics profile, so the fingerprint (and every cache) of a fast model differs from exact.
        hold_weights: False for a process whose models compute elsewhere (a model process): the weights
            are read on the CPU, fingerprinted, and released (`ServedModel.weights_held`).

    Raises:
        FileNotFoundError, model.CheckpointMismatch: a broken checkpoint.
        ValueError: an unknown kernel_backend, cpu path or math, or a portable path that is not in force
            (naming what differs).
    """
    if linear_math not in MATH_MODES:
        raise ValueError(f"model {spec.name}: linear_math must be one of {MATH_MODES}, got {linear_math!r}")
    cpu_path = resolve_cpu_path(cpu_path)
    problems = in_force_problems(cpu_path)
    if problems:
        raise ValueError(
            f"model {spec.name}: the {cpu_path} numerics profile is not in force in this process "
            f"({'; '.join(problems)}); start it through `kvresume` (which applies it) or serve "
            "model_numerics='native'"
        )
    root = repo_root()
    # released weights are read once on the CPU (the fingerprint hashes the same bytes wherever they are)
    model = _load_weights(spec, device if hold_weights else "cpu", kernel_backend)
    if hold_weights and device == "cpu" and kernel_backend == "torch":
        # the compiled sparse attention's first-use probes of the widths every pass takes (the window, and
        # the window plus the selection), now rather than in the first turns served (kernels/README.md)
        cfg = model.cfg
        prepare_sparse_attn(cfg.n_heads, cfg.head_dim, (cfg.window_size, cfg.window_size + cfg.index_topk))
    if spec.checkpoint is not None:
        candidates = [
            spec.checkpoint / "tokenizer.json",
            root / "checkpoints" / "tokenizer" / "tokenizer.json",
        ]
    else:
        candidates = [root / "checkpoints" / "tokenizer" / "tokenizer.json"]
    set_linear_math(model, linear_math)
    numerics = NumericsProfile.for_device(
        device,
        kernel_backend=model.kernel_backend,
        cpu_path=cpu_path,
        math=linear_math,
        native_host=native_host_id() if cpu_path == "native" else "",
    )
    alternates = None
    with torch.inference_mode():
        fingerprint = model_fingerprint(model, numerics=numerics)
        if not hold_weights:
            alternates = pinned_alternates(model, numerics)
            # what is left: the config and the module structure, no storage
            model = model.to("meta")
    return ServedModel(
        spec=spec,
        model=model,
        fingerprint=fingerprint,
        numerics=numerics,
        codec=choose_codec(model.cfg.vocab_size, candidates),
        device=device,
        weights_held=hold_weights,
        pinned_alternates=alternates,
    )


def _load_weights(spec: ServedModelSpec, device: str, kernel_backend: str) -> Transformer:
    """The spec's model with its weights (the checkpoint's, or the seeded stand-in's) on `device`, in
    eval mode."""
    if spec.checkpoint is not None:
        model = load_model(spec.checkpoint, device=device)
        model.kernel_backend = kernel_backend
    else:
        model = Transformer(_config_of(spec), kernel_backend=kernel_backend)
        model = init_random(model, seed=spec.seed).to(device)
    return model.eval()


def pinned_alternates(model: Transformer, numerics: NumericsProfile) -> frozenset[str]:
    """Hex fingerprints of `model`'s very weights and config under the other pinned CPU path (empty when
    `numerics` is under neither). One model's caches differ between the pinned paths only in rounding,
    so a mapper fitted under one is the same learned map under the other."""
    if numerics.cpu_path not in PINNED_ENVS:
        return frozenset()
    with torch.inference_mode():
        return frozenset(
            model_fingerprint(model, numerics=dataclasses.replace(numerics, cpu_path=p)).hex()
            for p in PINNED_ENVS
            if p != numerics.cpu_path
        )


class ModelRegistry:
    """Served models by name, loaded on first use (thread-safe)."""

    def __init__(
        self,
        specs: Mapping[str, ServedModelSpec],
        *,
        device: str = "cpu",
        kernel_backend: str = "torch",
        cpu_path: str = "auto",
        linear_math: str = "exact",
        hold_weights: bool = True,
    ) -> None:
        for name, spec in specs.items():
            if name != spec.name:
                raise ValueError(f"served model key {name!r} differs from its spec name {spec.name!r}")
        if kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}")
        self._specs = dict(specs)
        self._device = device
        if cpu_path not in CPU_PATH_CHOICES:
            raise ValueError(f"numerics cpu path must be one of {CPU_PATH_CHOICES}, got {cpu_path!r}")
        cpu_path = resolve_cpu_path(cpu_path)
        if linear_math not in MATH_MODES:
            raise ValueError(f"linear_math must be one of {MATH_MODES}, got {linear_math!r}")
        self._kernel_backend = kernel_backend
        self._cpu_path = cpu_path
        self._linear_math = linear_math
        self._hold_weights = hold_weights
        self._loaded: dict[str, ServedModel] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_sources(
        cls,
        sources: Mapping[str, str],
        *,
        device: str = "cpu",
        kernel_backend: str = "torch",
        cpu_path: str = "auto",
        linear_math: str = "exact",
        hold_weights: bool = True,
    ) -> ModelRegistry:
        """From settings' name -> source strings; empty: `default_model_specs()`."""
        specs = (
            default_model_specs()
            if not sources
            else {n: ServedModelSpec.parse(n, s) for n, s in sources.items()}
        )
        return cls(
            specs,
            device=device,
            kernel_backend=kernel_backend,
            cpu_path=cpu_path,
            linear_math=linear_math,
            hold_weights=hold_weights,
        )

    @property
    def device(self) -> str:
        return self._device

    @property
    def kernel_backend(self) -> str:
        return self._kernel_backend

    @property
    def cpu_path(self) -> str:
        return self._cpu_path

    @property
    def linear_math(self) -> str:
        return self._linear_math

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def spec(self, name: str) -> ServedModelSpec | None:
        return self._specs.get(name)

    def get(self, name: str) -> ServedModel | None:
        """The loaded model, or None when `name` is not served here."""
        spec = self._specs.get(name)
        if spec is None:
            return None
        with self._lock:
            served = self._loaded.get(name)
            if served is None:
                # never as inference tensors, whoever asks (the model process asks inside its serving
                # loop's inference mode): they keep no version counter, so a Linear could cache neither its
                # packed bf16 weight nor its decoded FP8/FP4 one and redid that work on every call
                # (measured: pack_weight was a third of the bf16 linears' time in the model process of a
                # 64-session load run)
                with torch.inference_mode(False):
                    served = load_served(
                        spec,
                        device=self._device,
                        kernel_backend=self._kernel_backend,
                        cpu_path=self._cpu_path,
                        linear_math=self._linear_math,
                        hold_weights=self._hold_weights,
                    )
                self._loaded[name] = served
            return served
