"""The nonlinear fallback of one mapped part: a one-hidden-layer MLP on context features, added to the
part's ridge prediction (it fits the ridge residual), for the parts whose ridge fails its part gate.

Knows nothing of artifacts' files or of how parts are chosen (fit.py). Features of entry j of a receiver
source of ratio m (all content space, fp32):

- the sender's stacked sources of the part at entries j, j-1, ..., j-context (zeros before entry 0);
- the sender's main KV of every source of the other ratios (`other_layers`) at the entry covering the
  same tokens (ratio m' > m: entry j*m // m', zeros where that group is still open; m' < m: the mean of
  the m/m' entries inside entry j);
- the receiver's own token embeddings, averaged over the entry's m tokens (no sender information: a
  receiver-side prior of what the entry holds; it needs the history's tokens and the receiver's weights).

    f = standardise(features);  y = x_j · coefᵀ + intercept + W2 · gelu(W1 · f + b1) + b2

`mlp_predict` is the batched path; `mlp_predict_rows` its slow twin, one row at a time from plain Python
loops over the same arrays, which the tests hold it to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["MlpFeatures", "build_features", "fit_mlp_residual", "mlp_predict", "mlp_predict_rows"]

MLP_ARRAYS = ("mu", "sigma", "w1", "b1", "w2", "b2")


@dataclass(frozen=True, kw_only=True)
class MlpFeatures:
    """Which context an MLP part reads (recorded in the artifact).

    context: previous entries of the part's own sender input; other_layers: sender kv sources of other
    ratios whose main KV is read; embed: the receiver's token embeddings; hidden: the hidden width.
    """

    context: int = 2
    other_layers: tuple[int, ...] = ()
    embed: bool = True
    hidden: int = 512

    def __post_init__(self) -> None:
        if self.context < 0 or self.hidden < 1:
            raise ValueError(f"context={self.context} must be >= 0 and hidden={self.hidden} >= 1")
        object.__setattr__(self, "other_layers", tuple(int(s) for s in self.other_layers))

    def to_dict(self) -> dict:
        return {"context": self.context, "other_layers": list(self.other_layers), "embed": self.embed,
                "hidden": self.hidden}

    @classmethod
    def from_dict(cls, where: str, data: object) -> MlpFeatures:
        if not isinstance(data, dict) or set(data) != {"context", "other_layers", "embed", "hidden"}:
            raise ValueError(f"{where}: features must hold exactly context, other_layers, embed, hidden")
        try:
            return cls(context=int(data["context"]), other_layers=tuple(data["other_layers"]),
                       embed=bool(data["embed"]), hidden=int(data["hidden"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [B, n, D] delayed by k entries along n (zeros first)."""
    if k == 0:
        return x
    out = torch.zeros_like(x)
    out[:, k:] = x[:, : x.size(1) - k] if x.size(1) > k else out[:, k:]
    return out


def _other_ratio(src: torch.Tensor, m_src: int, m: int, n: int) -> torch.Tensor:
    """Entries of a ratio-m_src source aligned to n entries of ratio m: [B, n, D]."""
    b, _, d = src.shape
    if m_src > m:
        idx = torch.arange(n, device=src.device) * m // m_src
        out = torch.zeros(b, n, d, dtype=src.dtype, device=src.device)
        ok = idx < src.size(1)
        out[:, ok] = src[:, idx[ok]]
        return out
    per = m // m_src
    return src[:, : n * per].reshape(b, n, per, d).mean(2)


def build_features(
    own: Sequence[torch.Tensor],
    others: Mapping[int, tuple[int, torch.Tensor]],
    feats: MlpFeatures,
    ratio: int,
    n: int,
    *,
    embed_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Context features [B, n, F] fp32 of n entries of a ratio-`ratio` receiver source.

    Args:
        own: per sender layer of the part, [B, >=n, D_in] content (the ridge input, stacked in order).
        others: sender layer -> (its ratio, [B, entries, D] main-KV content), for `feats.other_layers`.
        embed_rows: [B, n * ratio, dim] receiver token embeddings of the history (when `feats.embed`).

    Raises:
        ValueError: embeddings asked for and not given, or an other layer missing.
    """
    x = torch.cat([t[:, :n].float() for t in own], -1)
    parts = [_shift(x, k) for k in range(feats.context + 1)]
    for s in feats.other_layers:
        if s not in others:
            raise ValueError(f"features read sender layer {s}, which was not given")
        m_src, t = others[s]
        parts.append(_other_ratio(t.float(), m_src, ratio, n))
    if feats.embed:
        if embed_rows is None:
            raise ValueError("these features read the receiver's token embeddings: pass embed_rows")
        e = embed_rows[:, : n * ratio].float()
        parts.append(e.reshape(e.size(0), n, ratio, e.size(-1)).mean(2))
    return torch.cat(parts, -1)


def mlp_predict(arrays: Mapping[str, torch.Tensor], x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Ridge + MLP residual, batched: x [..., k*D_in] ridge input, f [..., F] features -> [..., D_out]."""
    z = (f - arrays["mu"]) / arrays["sigma"]
    h = torch.nn.functional.gelu(z @ arrays["w1"].T + arrays["b1"])
    return x @ arrays["coef"].T + arrays["intercept"] + h @ arrays["w2"].T + arrays["b2"]


def mlp_predict_rows(arrays: Mapping[str, torch.Tensor], x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """The slow twin of `mlp_predict`: one row at a time, sums in fp64 Python loops over lists."""
    a = {k: v.double().tolist() for k, v in arrays.items()}
    xs, fs = x.reshape(-1, x.size(-1)).double().tolist(), f.reshape(-1, f.size(-1)).double().tolist()
    rows = []
    for xr, fr in zip(xs, fs, strict=True):
        z = [(v - m) / s for v, m, s in zip(fr, a["mu"], a["sigma"], strict=True)]
        h = []
        for w, b in zip(a["w1"], a["b1"], strict=True):
            u = sum(wi * zi for wi, zi in zip(w, z, strict=True)) + b
            h.append(0.5 * u * (1.0 + math.erf(u / math.sqrt(2.0))))
        out = []
        for q in range(len(a["intercept"])):
            lin = sum(c * v for c, v in zip(a["coef"][q], xr, strict=True)) + a["intercept"][q]
            res = sum(w * v for w, v in zip(a["w2"][q], h, strict=True)) + a["b2"][q]
            out.append(lin + res)
        rows.append(out)
    return torch.tensor(rows, dtype=torch.float32).reshape(*x.shape[:-1], -1)


def fit_mlp_residual(
    f: torch.Tensor,
    residual: torch.Tensor,
    *,
    hidden: int,
    weights: torch.Tensor | None = None,
    epochs: int = 20,
    batch: int = 512,
    lr: float = 1e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Train the residual MLP on rows f [N, F] -> residual [N, D_out] (weighted MSE when `weights` [N]).

    Returns the fp32 arrays mu, sigma, w1, b1, w2, b2 (w2 starts at zero, so step 0 is the ridge plus the
    mean residual). Trains with autograd even under a caller's `torch.inference_mode` (the fit runs in one).
    """
    # inference tensors cannot be saved for backward: copy the rows out of inference mode first
    with torch.inference_mode(False), torch.enable_grad():
        return _train(f.clone(), residual.clone(), hidden, None if weights is None else weights.clone(),
                      epochs, batch, lr, weight_decay, seed)


def _train(f, residual, hidden, weights, epochs, batch, lr, weight_decay, seed) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n, width = f.shape
    mu = f.mean(0)
    sigma = f.std(0).clamp_min(1e-6)
    z = (f - mu) / sigma
    w1 = torch.nn.Parameter(torch.randn(hidden, width, generator=g) * width**-0.5)
    b1 = torch.nn.Parameter(torch.zeros(hidden))
    w2 = torch.nn.Parameter(torch.zeros(residual.size(1), hidden))
    b2 = torch.nn.Parameter(residual.mean(0).clone())
    params = [w1, b1, w2, b2]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    w = torch.ones(n) if weights is None else weights.float() * (n / weights.float().sum())
    steps = epochs * max(1, math.ceil(n / batch))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch):
            idx = order[i : i + batch]
            h = torch.nn.functional.gelu(z[idx] @ w1.T + b1)
            err = (h @ w2.T + b2 - residual[idx]).square().mean(-1)
            loss = (err * w[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return {"mu": mu, "sigma": sigma, "w1": w1.detach().clone(), "b1": b1.detach().clone(),
            "w2": w2.detach().clone(), "b2": b2.detach().clone()}
