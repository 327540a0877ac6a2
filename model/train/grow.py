"""Growing a sibling from a smaller one's trained weights: a function-preserving deepening.

Knows nothing of training loops. `grow_model(small, big_cfg, n_new)` puts `n_new` new sliding-window layers
*below* the small model's first layer and copies every other weight (embedding, the small model's layers
shifted up by `n_new`, final norm, head) unchanged. The grown model computes the small one's function up
to rounding:

- a new layer's attention output projection (`attn.wo_b`) and its FFN's down projections (`w2` of every
  routed and the shared expert) are zero, so each new sub-block adds nothing to the residual stream;
- its lanes all equal the token embedding (the embedding is repeated over the mHC lanes), and the lane
  mix (`comb`) is doubly stochastic, so mixing equal lanes returns them unchanged whatever the mixer
  weights are;
- the first old layer then collapses equal lanes with the new layers' pre-mix instead of the one-hot
  first-layer pre-mix: the collapse is the embedding times the pre-mix's (positive) sum, and its
  RMSNorm removes that scale.

A layer inserted anywhere else would not preserve the function: the next layer's pre-mix is computed
from the previous layer's mid-block lanes (V41_SPEC §8), which an inserted layer cannot reproduce.
The new layers keep the random init of everything else (query, KV, router, expert inputs), so
training can grow them apart; their zero projections receive gradients at once.

Grown siblings of the family (`GROWN_FROM`): trained further with `kvresume train --model NAME`, which
starts from the base's shipped checkpoint when no resume state exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import ModelConfig
from model.transformer import Transformer
from model.weights import init_random

__all__ = ["GROWN_FROM", "GrowRecipe", "grow_model", "grown_from", "grown_sibling"]


@dataclass(frozen=True)
class GrowRecipe:
    """base: the sibling whose shipped checkpoint is grown; new_bottom_layers: SWA layers added below."""

    base: str
    new_bottom_layers: int


GROWN_FROM: dict[str, GrowRecipe] = {"v41-sib-m": GrowRecipe(base="v41-sib-s", new_bottom_layers=2)}


def grown_from(name: str) -> GrowRecipe | None:
    """The recipe of a grown sibling, None for a sibling trained from a random init."""
    return GROWN_FROM.get(name)


def _check_shapes(small: ModelConfig, big: ModelConfig, n_new: int) -> None:
    if n_new < 1:
        raise ValueError(f"n_new={n_new} must be >= 1")
    if big.n_layers != small.n_layers + n_new:
        raise ValueError(f"grown n_layers {big.n_layers} != {small.n_layers} + {n_new}")
    want = [0] * n_new + list(small.compress_ratios)
    if list(big.compress_ratios) != want:
        raise ValueError(f"grown compress_ratios {list(big.compress_ratios)} != {want} (new layers are SWA)")
    shifted = {
        "kv_source_layers": [i + n_new for i in small.kv_source_layers],
        "index_source_layers": [i + n_new for i in small.index_source_layers],
    }
    for key, value in shifted.items():
        if list(getattr(big, key)) != value:
            raise ValueError(f"grown {key} {list(getattr(big, key))} != {value}")
    if big.candidate_source_layer != small.candidate_source_layer + n_new:
        want_cand = small.candidate_source_layer + n_new
        raise ValueError(f"grown candidate_source_layer {big.candidate_source_layer} != {want_cand}")
    for key in ("dim", "vocab_size", "n_heads", "head_dim", "hc_mult", "window_size", "n_routed_experts"):
        if getattr(big, key) != getattr(small, key):
            raise ValueError(f"grown {key}={getattr(big, key)} differs from the base's {getattr(small, key)}")


def grow_model(small: Transformer, big_cfg: ModelConfig, n_new: int, *, seed: int = 0) -> Transformer:
    """A model of `big_cfg` computing `small`'s function: `n_new` zero-output SWA layers below a copy of
    every `small` weight (see the module doc). Returned in `small`'s parameter dtypes of a fresh
    `Transformer(big_cfg)`.

    Raises:
        ValueError: `big_cfg` is not `small`'s config with `n_new` SWA layers added at the bottom.
    """
    _check_shapes(small.cfg, big_cfg, n_new)
    big = init_random(Transformer(big_cfg), seed=seed)
    src = small.state_dict()
    dst = big.state_dict()
    with torch.no_grad():
        for name, p in dst.items():
            if name.startswith("layers."):
                layer = int(name.split(".")[1])
                rest = name.split(".", 2)[2]
                if layer < n_new:
                    if rest == "attn.wo_b.weight" or rest.endswith(".w2.weight"):
                        p.zero_()
                    continue
                old = f"layers.{layer - n_new}.{rest}"
            else:
                old = name
            if old not in src or src[old].shape != p.shape:
                raise ValueError(f"no weight of shape {tuple(p.shape)} for {name} in the base ({old})")
            p.copy_(src[old].to(p.dtype))
    return big


def grown_sibling(name: str, base_checkpoint: str | Path | None = None, *, seed: int = 0) -> Transformer:
    """The step-0 model of grown sibling `name`: its base's shipped checkpoint (or `base_checkpoint`) grown.

    Raises:
        ValueError: `name` is not a grown sibling.
    """
    from model.train.family import sibling_config
    from model.weights import load_model

    recipe = grown_from(name)
    if recipe is None:
        raise ValueError(f"{name!r} is not a grown sibling; grown: {sorted(GROWN_FROM)}")
    path = base_checkpoint or Path(__file__).resolve().parents[2] / "checkpoints" / recipe.base
    small = load_model(path)
    return grow_model(small, sibling_config(name), recipe.new_bottom_layers, seed=seed)
