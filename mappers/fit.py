"""Fitting a mapper between two models: capture both models' global KV on the same tokens, stream the
sufficient statistics of every (ratio, part) block, pick for each receiver kv source the sender sources
of its ratio that predict it best, and solve one ridge per (receiver source, part).

Knows nothing of evaluation or gating (see evaluate.py): the fitted mapper carries R² figures only and
`passed_gate=False`. Rows are compressed entries: entry j of a ratio-m source in both models pools the
same tokens [j*m, (j+1)*m), so the two captures line up row for row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mappers.apply import recompute_index
from mappers.artifact import GateSpec, KVMapper, LayerMap, ModelRef, PartMap
from mappers.capture import ContentKV, capture_content
from mappers.errors import FitError
from mappers.geometry import sources_of
from mappers.ridge import MomentStats, RidgeMapper, r2_from_stats
from model import Transformer, model_fingerprint

_PARTS = ("kv", "index")
INDEX_MODES = ("map", "recompute", "best")


@dataclass(frozen=True, kw_only=True)
class FitSpec:
    """Hyperparameters of a fit.

    Attributes:
        k: sender layers stacked per receiver source (None: every sender source of the same ratio).
        alphas: relative ridge penalties tried per (receiver source, part); the best held-out R² wins
            (with no held-out rows the in-sample R², which favours the smallest).
        selection_alpha: the relative penalty of the single-layer probes that rank sender layers.
        index_mode: index keys from a separate ridge map ("map"), recomputed from the mapped main KV with
            the receiver's own indexer ("recompute", V41_SPEC §4.1), or whichever has the higher held-out
            R² per layer ("best"; needs held-out batches).
    """

    k: int | None = None
    alphas: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)
    selection_alpha: float = 1e-2
    index_mode: str = "map"

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 1:
            raise ValueError(f"k must be >= 1 or None, got {self.k}")
        object.__setattr__(self, "alphas", tuple(float(a) for a in self.alphas))
        if not self.alphas or any(not (math.isfinite(a) and a >= 0) for a in self.alphas):
            raise ValueError(f"alphas must be non-empty, finite and >= 0, got {list(self.alphas)}")
        if not (math.isfinite(self.selection_alpha) and self.selection_alpha >= 0):
            raise ValueError(f"selection_alpha must be finite and >= 0, got {self.selection_alpha}")
        if self.index_mode not in INDEX_MODES:
            raise ValueError(f"index_mode must be one of {INDEX_MODES}, got {self.index_mode!r}")


def _width(cfg, part: str) -> int:
    return cfg.head_dim if part == "kv" else cfg.index_head_dim


def _cols(position: int, width: int) -> torch.Tensor:
    return torch.arange(position * width, (position + 1) * width)


class _Blocks:
    """Train and held-out statistics of every (ratio, part): X = all sender sources of the ratio stacked,
    Y = all receiver sources of the ratio stacked."""

    def __init__(self, s_cfg, r_cfg, senders: dict[int, list[int]], receivers: dict[int, list[int]], device):
        self.senders, self.receivers = senders, receivers
        self.stats = {
            (m, part, split): MomentStats(
                len(senders[m]) * _width(s_cfg, part), len(receivers[m]) * _width(r_cfg, part), device
            )
            for m in receivers
            for part in _PARTS
            for split in ("train", "heldout")
        }

    def add(self, split: str, cs: ContentKV, cr: ContentKV) -> None:
        for m in self.receivers:
            for part in _PARTS:
                x = torch.cat([cs.part(part)[s] for s in self.senders[m]], -1).flatten(0, 1)  # [B*n, S*D]
                y = torch.cat([cr.part(part)[r] for r in self.receivers[m]], -1).flatten(0, 1)  # [B*n, R*D]
                if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
                    raise FitError(f"non-finite captured {part} entries at ratio {m}")
                self.stats[(m, part, split)].update(x, y)


def _score(fit: RidgeMapper, train: MomentStats, heldout: MomentStats, xi, yi) -> float:
    stats = heldout if heldout.n else train
    return r2_from_stats(stats, fit.coef_, fit.intercept_, xi, yi)[1]


def _fit_part(spec: FitSpec, train: MomentStats, held: MomentStats, senders: list[int], r_pos: int,
              w_in: int, w_out: int):
    """Rank the sender layers of one (ratio, part) block for one receiver source, stack the best k and
    pick alpha. Returns (fit, chosen layers, relative alpha, score, x columns, y columns)."""
    device = train.cxx.device
    yi = _cols(r_pos, w_out).to(device)
    probe = {}
    for pos, s in enumerate(senders):
        xi = _cols(pos, w_in).to(device)
        fit = RidgeMapper(spec.selection_alpha).fit_stats(train, xi, yi)
        probe[s] = _score(fit, train, held, xi, yi)
    ranked = sorted(senders, key=lambda s: -probe[s])
    chosen = sorted(ranked[: spec.k] if spec.k else ranked)
    xi = torch.cat([_cols(senders.index(s), w_in) for s in chosen]).to(device)
    best: tuple[float, float, RidgeMapper] | None = None
    for alpha in spec.alphas:
        fit = RidgeMapper(alpha).fit_stats(train, xi, yi)
        score = _score(fit, train, held, xi, yi)
        # ties go to the larger penalty (the later alpha when sorted ascending)
        if best is None or score >= best[0]:
            best = (score, alpha, fit)
    assert best is not None
    score, alpha, fit = best
    return fit, chosen, alpha, score, xi, yi


def _recompute_r2(
    receiver_model: Transformer,
    layer: int,
    kv_fit: RidgeMapper,
    kv_senders: list[int],
    captures: list[tuple[ContentKV, ContentKV]],
) -> float | None:
    """Held-out R² (content space, pooled) of index keys recomputed by the receiver's indexer from the
    mapped main KV; None without held-out rows."""
    sse = 0.0
    own_rows = []
    for cs, cr in captures:
        x = torch.cat([cs.kv[s] for s in kv_senders], dim=-1)  # [B, n, k*D]
        latent = kv_fit.predict(x)  # [B, n, D]
        # no rotation: compare in content space with the receiver's stripped keys
        rd = receiver_model.cfg.rope_head_dim
        still = torch.ones(latent.size(1), rd // 2, dtype=torch.complex64, device=latent.device)
        keys = recompute_index(receiver_model, layer, latent, still)[0].float().to(latent.device)
        own = cr.index[layer]
        sse += float(((keys - own) ** 2).sum())
        own_rows.append(own.flatten(0, 1))
    if not own_rows:
        return None
    own = torch.cat(own_rows)
    sst = float(((own - own.mean(0)) ** 2).sum())
    return 1.0 - sse / max(sst, torch.finfo(torch.float64).tiny)


@torch.no_grad()
def fit_mapper(
    sender_model: Transformer,
    receiver_model: Transformer,
    token_batches: Iterable[torch.Tensor],
    *,
    heldout_batches: Iterable[torch.Tensor] = (),
    spec: FitSpec | None = None,
    sender_name: str = "sender",
    receiver_name: str = "receiver",
    gate: GateSpec | None = None,
    sender_fingerprint: bytes | None = None,
    receiver_fingerprint: bytes | None = None,
) -> KVMapper:
    """Fit a ridge mapper from `sender_model`'s global KV to `receiver_model`'s.

    Args:
        token_batches: [B, T] int64 token batches both models prefill (calibration rows).
        heldout_batches: disjoint batches for layer ranking and alpha choice (recommended).
        spec: hyperparameters (FitSpec defaults when None).
        gate: thresholds recorded in the artifact for `evaluate_mapper` (GateSpec defaults when None).
        sender_fingerprint, receiver_fingerprint: the fingerprints to bind (default: `model_fingerprint`
            of each model with its default numerics profile).

    Returns:
        a KVMapper bound to both fingerprints, quality = per-layer R² (train and held-out), passed_gate
        False until evaluated.

    Raises:
        ValueError: a receiver source whose ratio no sender source has; index_mode "best" without
            held-out batches.
        FitError: no calibration rows, or non-finite captures.
    """
    spec = spec or FitSpec()
    s_cfg, r_cfg = sender_model.cfg, receiver_model.cfg
    receivers: dict[int, list[int]] = {}
    for src in sources_of(r_cfg):
        receivers.setdefault(src.ratio, []).append(src.layer)
    senders = {m: [s.layer for s in sources_of(s_cfg) if s.ratio == m] for m in receivers}
    for m, layers in senders.items():
        if not layers:
            raise ValueError(
                f"receiver kv sources {receivers[m]} have ratio {m}; no sender kv source has that ratio"
            )
    # statistics live where the captures are (the accumulation GEMMs run on the models' device)
    device = next(sender_model.parameters()).device
    blocks = _Blocks(s_cfg, r_cfg, senders, receivers, device)
    # index "recompute" is scored on the held-out rows themselves (a nonlinear map: no moments suffice)
    held_captures: list[tuple[ContentKV, ContentKV]] = []
    for split, batches in (("train", token_batches), ("heldout", heldout_batches)):
        for tokens in batches:
            cs, _ = capture_content(sender_model, tokens)
            cr, _ = capture_content(receiver_model, tokens)
            blocks.add(split, cs, cr)
            if split == "heldout" and spec.index_mode != "map":
                held_captures.append((cs, cr))
    if spec.index_mode == "best" and not held_captures:
        raise ValueError("index_mode='best' compares on held-out rows: pass heldout_batches")

    layers, arrays, pair_r2 = [], {}, {part: [] for part in _PARTS}
    for src in sources_of(r_cfg):
        m, r = src.ratio, src.layer
        parts, quality, fits = {}, {}, {}
        for part in _PARTS:
            train, held = blocks.stats[(m, part, "train")], blocks.stats[(m, part, "heldout")]
            if train.n == 0:
                raise FitError(f"no calibration rows for ratio {m}: use batches of at least {m} tokens")
            fit, chosen, alpha, score, xi, yi = _fit_part(
                spec, train, held, senders[m], receivers[m].index(r), _width(s_cfg, part), _width(r_cfg, part)
            )
            if not bool(torch.isfinite(fit.coef_).all() and torch.isfinite(fit.intercept_).all()):
                raise FitError(f"receiver layer {r} {part}: the ridge solve is not finite")
            fits[part] = (fit, chosen)
            parts[part] = PartMap(kind="linear", sender_layers=tuple(chosen), alpha=fit.alpha_)
            quality[f"r2_{part}_train"] = r2_from_stats(train, fit.coef_, fit.intercept_, xi, yi)[1]
            if held.n:
                quality[f"r2_{part}_heldout"] = score
            quality[f"alpha_relative_{part}"] = alpha
            quality[f"rows_{part}"] = float(train.n)
            if part == "index" and spec.index_mode != "map":
                kv_fit, kv_chosen = fits["kv"]
                r2_re = _recompute_r2(receiver_model, r, kv_fit, kv_chosen, held_captures)
                if r2_re is not None:
                    quality["r2_index_recompute_heldout"] = r2_re
                if spec.index_mode == "recompute" or (r2_re is not None and r2_re > score):
                    parts[part] = PartMap(kind="recompute", sender_layers=tuple(kv_chosen))
                    score = r2_re if r2_re is not None else score
            if parts[part].kind == "linear":
                arrays[f"layers.{r}.{part}.coef"] = fit.coef_.cpu()
                arrays[f"layers.{r}.{part}.intercept"] = fit.intercept_.cpu()
            pair_r2[part].append(score)
        layers.append(
            LayerMap(receiver_layer=r, ratio=m, kv=parts["kv"], index=parts["index"], quality=quality)
        )
    which = "heldout" if any(blocks.stats[(m, "kv", "heldout")].n for m in receivers) else "train"
    pair_quality = {f"r2_{part}_{which}_mean": sum(v) / len(v) for part, v in pair_r2.items()}
    fp_s = sender_fingerprint or model_fingerprint(sender_model)
    fp_r = receiver_fingerprint or model_fingerprint(receiver_model)
    return KVMapper(
        sender=ModelRef(name=sender_name, fingerprint=fp_s.hex(), config=s_cfg),
        receiver=ModelRef(name=receiver_name, fingerprint=fp_r.hex(), config=r_cfg),
        layers=tuple(layers),
        arrays=arrays,
        gate=gate or GateSpec(),
        quality=pair_quality,
        passed_gate=False,
    )
