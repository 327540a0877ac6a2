"""Fitting a mapper between two models: capture both models' global KV on the same tokens, stream the
sufficient statistics of every (ratio, part) block, pick for each receiver kv source the sender sources
of its ratio that predict it best, and solve one ridge per (receiver source, part).

Per-part choice: ridge is the first choice and is kept wherever its held-out R² passes the part gate
(`FitSpec.part_gate_r2`); with `fallback="mlp"` a part that fails it gets a residual MLP on context
features (mappers/mlp.py), kept when its held-out R² beats the ridge's. Each part records why (`reason`).

Knows nothing of evaluation or gating (see evaluate.py): the fitted mapper carries R² figures only and
`passed_gate=False`. Rows are compressed entries: entry j of a ratio-m source in both models pools the
same tokens [j*m, (j+1)*m), so the two captures line up row for row.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mappers.apply import recompute_index
from mappers.artifact import GateSpec, KVMapper, LayerMap, ModelRef, PartMap
from mappers.capture import ContentKV, capture_content
from mappers.errors import FitError
from mappers.geometry import sources_of
from mappers.mlp import MlpFeatures, build_features, fit_mlp_residual, mlp_predict
from mappers.ridge import MomentStats, RidgeMapper, r2_from_stats
from model import Transformer, model_fingerprint

_PARTS = ("kv", "index")
INDEX_MODES = ("map", "recompute", "best")
FALLBACKS = ("none", "mlp")


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
        part_gate_r2: the held-out R² a part's ridge must reach to be kept without trying the fallback
            (about 0.94 along the direction the receiver reads was needed for 90% recall on the shipped
            siblings, issue 12's diagnosis).
        fallback: "none" (ridge everywhere) or "mlp" (a residual MLP for parts failing the part gate; needs
            held-out batches to decide).
        mlp_context, mlp_hidden, mlp_epochs, mlp_embed, mlp_other_ratio: the fallback's features (previous
            entries, receiver token embeddings, the sender's sources of the other ratios) and training.
        attention_weighted: weight every calibration and held-out row (ridge moments, the MLP's loss and
            its R²) by how much the receiver's own attention reads that entry (`model.attention_mass`:
            summed over heads, queries and the layers reading the source, divided by its batch mean),
            plus `weight_floor` so no row counts for nothing. Task-free: no answer positions are used.
        force_mlp: parts ("LAYER.kv" / "LAYER.index", receiver layers) that try the MLP fallback even when
            their ridge passes the part gate: a part gate on R² can pass a part whose remaining error
            still moves the receiver's next-token distribution (the per-part KL diagnosis of issue 12).
            The MLP is still kept only when its held-out R² beats the ridge's. Needs fallback="mlp".
    """

    k: int | None = None
    alphas: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)
    selection_alpha: float = 1e-2
    index_mode: str = "map"
    part_gate_r2: float = 0.9
    fallback: str = "none"
    mlp_context: int = 2
    mlp_hidden: int = 512
    mlp_epochs: int = 20
    mlp_embed: bool = True
    mlp_other_ratio: bool = True
    attention_weighted: bool = False
    weight_floor: float = 0.1
    force_mlp: tuple[str, ...] = ()

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
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if not (math.isfinite(self.part_gate_r2) and self.part_gate_r2 <= 1):
            raise ValueError(f"part_gate_r2 must be finite and <= 1, got {self.part_gate_r2}")
        if not (math.isfinite(self.weight_floor) and self.weight_floor >= 0):
            raise ValueError(f"weight_floor must be finite and >= 0, got {self.weight_floor}")
        object.__setattr__(self, "force_mlp", tuple(str(p) for p in self.force_mlp))
        for name in self.force_mlp:
            layer, dot, part = name.partition(".")
            if not (dot and layer.isdigit() and part in _PARTS):
                raise ValueError(f"force_mlp entries must be LAYER.kv or LAYER.index, got {name!r}")
        if self.force_mlp and self.fallback != "mlp":
            raise ValueError(f"force_mlp={list(self.force_mlp)} needs fallback='mlp', got {self.fallback!r}")
        if self.mlp_context < 0 or self.mlp_hidden < 1 or self.mlp_epochs < 1:
            raise ValueError(
                f"mlp_context={self.mlp_context} must be >= 0, mlp_hidden={self.mlp_hidden} and "
                f"mlp_epochs={self.mlp_epochs} >= 1"
            )


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

    def add(self, split: str, cs: ContentKV, cr: ContentKV, weights: dict[int, torch.Tensor] | None = None):
        """weights: ratio -> [B, n] row weights (None: unweighted)."""
        for m in self.receivers:
            for part in _PARTS:
                x = torch.cat([cs.part(part)[s] for s in self.senders[m]], -1).flatten(0, 1)  # [B*n, S*D]
                y = torch.cat([cr.part(part)[r] for r in self.receivers[m]], -1).flatten(0, 1)  # [B*n, R*D]
                if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
                    raise FitError(f"non-finite captured {part} entries at ratio {m}")
                w = None if weights is None else weights[m].flatten()
                self.stats[(m, part, split)].update(x, y, w)


def _row_weights(
    spec: FitSpec, receiver_model: Transformer, tokens: torch.Tensor, receivers: dict[int, list[int]]
) -> dict[int, torch.Tensor]:
    """ratio -> [B, n] attention weights of one batch: the receiver's attention mass on each entry, summed
    over the ratio's receiver sources, over its batch mean, plus the floor."""
    from model import attention_mass

    mass = attention_mass(receiver_model, tokens)
    out = {}
    for m, layers in receivers.items():
        read = sum(mass[r] for r in layers)
        out[m] = read / read.mean().clamp_min(1e-12) + spec.weight_floor
    return out


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


def _pooled_r2(pred: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> float:
    """1 - SSE / SST over all columns; weighted by rows when `w` [N] is given."""
    w = torch.ones(y.size(0)) if w is None else w.float()
    mean = (w @ y) / w.sum()
    sse = float((w.unsqueeze(1) * (pred - y) ** 2).sum())
    sst = float((w.unsqueeze(1) * (y - mean) ** 2).sum())
    return 1.0 - sse / max(sst, torch.finfo(torch.float64).tiny)


def _mlp_rows(
    captures: list[tuple[ContentKV, ContentKV, torch.Tensor, dict | None]], part: str, chosen: list[int],
    r: int, m: int, feats: MlpFeatures, embed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ridge input x, features f, target y, row weights or None) of one part over captured batches, fp32
    on the CPU."""
    xs, fs, ys, ws = [], [], [], []
    for cs, cr, tokens, weights in captures:
        if weights is not None:
            ws.append(weights[m].flatten().float().cpu())
        own = [cs.part(part)[s] for s in chosen]
        n = own[0].size(1)
        others = {s: (cs.ratios[s], cs.kv[s]) for s in feats.other_layers}
        rows = embed[tokens.to(embed.device)].float() if feats.embed else None
        fs.append(build_features(own, others, feats, m, n, embed_rows=rows).flatten(0, 1).cpu())
        xs.append(torch.cat(own, -1).flatten(0, 1).float().cpu())
        ys.append(cr.part(part)[r].flatten(0, 1).float().cpu())
    return torch.cat(xs), torch.cat(fs), torch.cat(ys), torch.cat(ws) if ws else None


def _fit_mlp_part(
    spec: FitSpec, fit: RidgeMapper, chosen: list[int], part: str, r: int, m: int, other_layers: list[int],
    receiver_model: Transformer, train_caps, held_caps,
) -> tuple[MlpFeatures, dict[str, torch.Tensor], float]:
    """Train the residual MLP of one part on the calibration captures; (features, arrays, held-out R²)."""
    feats = MlpFeatures(
        context=spec.mlp_context, other_layers=tuple(other_layers) if spec.mlp_other_ratio else (),
        embed=spec.mlp_embed, hidden=spec.mlp_hidden,
    )
    embed = receiver_model.embed.weight
    coef, intercept = fit.coef_.float().cpu(), fit.intercept_.float().cpu()
    x, f, y, w = _mlp_rows(train_caps, part, chosen, r, m, feats, embed)
    residual = y - (x @ coef.T + intercept)
    arrays = fit_mlp_residual(f, residual, hidden=feats.hidden, epochs=spec.mlp_epochs, weights=w)
    xh, fh, yh, wh = _mlp_rows(held_caps, part, chosen, r, m, feats, embed)
    pred = mlp_predict(arrays | {"coef": coef, "intercept": intercept}, xh, fh)
    return feats, arrays, _pooled_r2(pred, yh, wh)


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
    calibration: dict | None = None,
) -> KVMapper:
    """Fit a ridge mapper from `sender_model`'s global KV to `receiver_model`'s.

    Args:
        token_batches: [B, T] int64 token batches both models prefill (calibration rows).
        heldout_batches: disjoint batches for layer ranking and alpha choice (recommended).
        spec: hyperparameters (FitSpec defaults when None).
        gate: thresholds recorded in the artifact for `evaluate_mapper` (GateSpec defaults when None).
        sender_fingerprint, receiver_fingerprint: the fingerprints to bind (default: `model_fingerprint`
            of each model with its default numerics profile).
        calibration: what the token batches are (corpus, seeds, `task_seeds` of any recall episodes the
            fit or its gate read), recorded in the artifact so `mapper eval` can refuse those episodes.

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
    # the mlp fallback trains on rows, not moments: keep every capture (and its tokens) when it may run
    mlp_caps: dict[str, list[tuple[ContentKV, ContentKV, torch.Tensor, dict | None]]] = {
        "train": [], "heldout": [],
    }
    for split, batches in (("train", token_batches), ("heldout", heldout_batches)):
        for tokens in batches:
            cs, _ = capture_content(sender_model, tokens)
            cr, _ = capture_content(receiver_model, tokens)
            weights = None
            if spec.attention_weighted:
                weights = _row_weights(spec, receiver_model, tokens, receivers)
            blocks.add(split, cs, cr, weights)
            if split == "heldout" and spec.index_mode != "map":
                held_captures.append((cs, cr))
            if spec.fallback == "mlp":
                mlp_caps[split].append((cs, cr, tokens, weights))
    if spec.index_mode == "best" and not held_captures:
        raise ValueError("index_mode='best' compares on held-out rows: pass heldout_batches")
    if spec.fallback == "mlp" and not mlp_caps["heldout"]:
        raise ValueError("fallback='mlp' decides on held-out rows: pass heldout_batches")
    known = {f"{src.layer}.{part}" for src in sources_of(r_cfg) for part in _PARTS}
    if unknown := sorted(set(spec.force_mlp) - known):
        raise ValueError(f"force_mlp names {unknown}, not parts of the receiver's kv sources {sorted(known)}")

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
            split = "held-out" if held.n else "in-sample"
            forced = f"{r}.{part}" in spec.force_mlp
            if forced:
                reason = ""
            elif score >= spec.part_gate_r2:
                reason = f"ridge: {split} R² {score:.3f} >= part gate {spec.part_gate_r2:g}"
            elif spec.fallback == "none":
                reason = f"ridge: {split} R² {score:.3f} < part gate {spec.part_gate_r2:g}, no fallback asked"
            else:
                reason = ""
            parts[part] = PartMap(kind="linear", sender_layers=tuple(chosen), alpha=fit.alpha_, reason=reason)
            quality[f"r2_{part}_train"] = r2_from_stats(train, fit.coef_, fit.intercept_, xi, yi)[1]
            if held.n:
                quality[f"r2_{part}_heldout"] = score
            mlp_arrays: dict[str, torch.Tensor] = {}
            if not reason:
                others = [s.layer for s in sources_of(s_cfg) if s.ratio != m]
                feats, mlp_arrays, r2_mlp = _fit_mlp_part(
                    spec, fit, chosen, part, r, m, others, receiver_model, mlp_caps["train"],
                    mlp_caps["heldout"],
                )
                quality[f"r2_{part}_mlp_heldout"] = r2_mlp
                cmp = ">=" if score >= spec.part_gate_r2 else "<"
                why = f"ridge held-out R² {score:.3f} {cmp} part gate {spec.part_gate_r2:g}"
                if forced:
                    why = f"forced ({r}.{part}); {why}"
                if r2_mlp > score:
                    parts[part] = PartMap(
                        kind="mlp", sender_layers=tuple(chosen), alpha=fit.alpha_, features=feats,
                        reason=f"mlp: {why}; residual mlp held-out R² {r2_mlp:.3f}",
                    )
                    score = r2_mlp
                else:
                    mlp_arrays = {}
                    parts[part] = dataclasses.replace(
                        parts[part], reason=f"ridge: {why}; the mlp was no better (R² {r2_mlp:.3f})"
                    )
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
            if parts[part].kind in ("linear", "mlp"):
                arrays[f"layers.{r}.{part}.coef"] = fit.coef_.cpu()
                arrays[f"layers.{r}.{part}.intercept"] = fit.intercept_.cpu()
            if parts[part].kind == "mlp":
                arrays |= {f"layers.{r}.{part}.mlp.{k}": v.float().cpu() for k, v in mlp_arrays.items()}
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
        calibration=dict(calibration or {}) | {"fit_spec": dataclasses.asdict(spec)},
    )
