"""Building a Transformer with weights: from a safetensors checkpoint (official quantized layout or our own
plain bf16/fp32 one), or seeded random weights in the checkpoint's storage dtypes; and saving plain ones.

Knows nothing of inference. Name/shape/dtype checking is `model.checkpoint.load_state_dict`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kernels import E4M3_MAX, quantize_mxfp4
from model.checkpoint import load_state_dict, save_state_dict
from model.config import ModelConfig
from model.linear import QUANT_BLOCK, Linear
from model.transformer import Transformer

# E8M0 exponent bias: byte b means 2^(b - 127)
_E8M0_BIAS = 127


def load_model(
    checkpoint: str | Path, config: ModelConfig | None = None, *, device: str | torch.device = "cpu"
) -> Transformer:
    """A model with the checkpoint's weights.

    Args:
        checkpoint: a directory holding config.json and *.safetensors (or an index), or a .safetensors file
            (then `config` is required).
        config: overrides the directory's config.json.
        device: where the model lives ("cpu", "cuda", ...), chosen by the caller.

    Raises:
        FileNotFoundError: no checkpoint or config.json.
        model.errors.CheckpointMismatch: a missing, extra, mis-shaped or mis-typed tensor (named).
        UnsupportedConfigError: the config enables Engram, MTP/DSpark or vision.
    """
    path = Path(checkpoint)
    if config is None:
        if not path.is_dir():
            raise ValueError(f"{path} is a file: pass its config explicitly")
        config = ModelConfig.from_json(path / "config.json")
    model = Transformer(config)
    # a vectors folder keeps other safetensors beside the weights: prefer the canonical file name
    weights = path / "model.safetensors" if path.is_dir() and (path / "model.safetensors").is_file() else path
    model.load_state_dict(load_state_dict(weights, model), strict=True)
    return model.to(device)


def save_plain(model: Transformer, directory: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write config.json and model.safetensors for a model whose weights are plain (config dtype "bf16",
    expert_dtype None), e.g. one we trained.

    Raises:
        ValueError: a quantized tensor (use the official converter's layout for those).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
    meta = {"config": json.dumps(model.cfg.to_dict())} | dict(metadata or {})
    save_state_dict(directory / "model.safetensors", model.state_dict(), meta)


def _fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (float8_e4m3fn [N, K], E8M0 [ceil(N/32), ceil(K/32)]) with power-of-two block scales."""
    n, k = w.shape
    pn, pk = -n % QUANT_BLOCK, -k % QUANT_BLOCK
    padded = torch.nn.functional.pad(w, (0, pk, 0, pn))
    blocks = padded.unflatten(0, (-1, QUANT_BLOCK)).unflatten(-1, (-1, QUANT_BLOCK))  # [N/32, 32, K/32, 32]
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [N/32, K/32]
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX))
    scale = torch.exp2(exponent)
    per_value = scale.repeat_interleave(QUANT_BLOCK, 0)[:n].repeat_interleave(QUANT_BLOCK, 1)[:, :k]
    codes = (w / per_value).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, (exponent + _E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


@torch.no_grad()
def init_random(model: Transformer, seed: int = 0) -> Transformer:
    """Fill every parameter with seeded random values in its storage dtype (for tests and benchmarks).

    Linear weights ~ N(0, 1/K) (FP8/FP4 ones quantized with their block scales), norms 1, embeddings N(0, 1),
    mHC projections small so the lane mixing starts near uniform. Returns the model.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    for module in model.modules():
        if isinstance(module, Linear):
            n, k = module.out_features, module.in_features
            w = normal((n, k), k**-0.5)
            if module.kind == "fp8":
                codes, scale = _fp8_block_quantize(w)
                module.weight.copy_(codes)
                module.scale.copy_(scale)
            elif module.kind == "fp4":
                packed, scale = quantize_mxfp4(w)
                module.weight.copy_(packed.view(torch.float4_e2m1fn_x2))
                module.scale.copy_(scale.view(torch.float8_e8m0fnu))
            else:
                module.weight.copy_(w.to(module.weight.dtype))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name == "embed.weight":
            p.copy_(normal(tuple(p.shape), 1.0).to(p.dtype))
        elif name == "head.weight":
            p.copy_(normal(tuple(p.shape), p.size(1) ** -0.5).to(p.dtype))
        elif name.endswith(("_fn",)):
            p.copy_(normal(tuple(p.shape), 1e-2 * p.size(1) ** -0.5))
        elif name.endswith("_scale") and p.dtype == torch.float32:
            p.fill_(1.0)
        elif name.endswith(("_base", "attn_sink", "gate.bias")):
            p.zero_()
        elif name.endswith("gate.weight"):
            p.copy_(normal(tuple(p.shape), p.size(1) ** -0.5).to(p.dtype))
    return model
