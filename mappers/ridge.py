"""Closed-form ridge regression from streamed sufficient statistics, and its scikit-learn twin.

Knows nothing of models or caches: rows in, a linear map out. Follows scikit-learn conventions (STYLE
rule 20): `__init__` stores hyperparameters only; `fit` sets `coef_` [Q, P], `intercept_` [Q], `alpha_`
(the absolute penalty used) and `n_features_in_`. `RidgeMapper` accumulates centred moments in fp32 with
Chan's pairwise merge and solves in fp64 by Cholesky; `SklearnRidgeMapper` solves the same problem with
`sklearn.linear_model.Ridge(solver="cholesky")` on the full rows (a correctness oracle for small data).
The closed form and the held-out R² expansion are derived in mappers/README.md.
"""

from __future__ import annotations

from typing import Protocol, Self

import numpy as np
import torch


class LinearMap(Protocol):
    """What a fitted KV map exposes: Y ≈ X @ coef_.T + intercept_."""

    coef_: torch.Tensor
    intercept_: torch.Tensor

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> Self: ...

    def predict(self, x: torch.Tensor) -> torch.Tensor: ...


class MomentStats:
    """Streaming sufficient statistics of paired rows x [N, P], y [N, Q].

    Holds n, the means (fp64) and the centred moments Cxx = Σ(x-x̄)ᵀ(x-x̄) [P, P], Cxy [P, Q] and the
    diagonal of Cyy [Q] (fp32). Batches are centred on their own means and merged with Chan's update, so
    no large uncentred sum is ever formed (it would cancel catastrophically in fp32).
    """

    def __init__(self, n_x: int, n_y: int, device: torch.device | str = "cpu") -> None:
        self.n = 0
        self.mean_x = torch.zeros(n_x, dtype=torch.float64, device=device)
        self.mean_y = torch.zeros(n_y, dtype=torch.float64, device=device)
        self.cxx = torch.zeros(n_x, n_x, dtype=torch.float32, device=device)
        self.cxy = torch.zeros(n_x, n_y, dtype=torch.float32, device=device)
        self.syy = torch.zeros(n_y, dtype=torch.float32, device=device)

    @property
    def n_x(self) -> int:
        return self.mean_x.numel()

    @property
    def n_y(self) -> int:
        return self.mean_y.numel()

    def update(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add rows x [N, P] and y [N, Q] (any float dtype; accumulated in fp32).

        weights: optional [N] non-negative row weights: the moments become weighted ones (weighted means,
        Σ w (x-x̄)ᵀ(x-x̄), ...) and `n` the total weight, so a ridge solve minimises Σ w ||y - Wx - b||².

        Raises:
            ValueError: widths or row counts that do not match, or negative / non-finite weights.
        """
        if x.ndim != 2 or y.ndim != 2 or x.size(0) != y.size(0):
            raise ValueError(
                f"x and y must be [N, P] and [N, Q] with the same N, got {list(x.shape)}, {list(y.shape)}"
            )
        if x.size(1) != self.n_x or y.size(1) != self.n_y:
            raise ValueError(
                f"widths {x.size(1)}, {y.size(1)} do not match the statistics' {self.n_x}, {self.n_y}"
            )
        nb = x.size(0)
        if nb == 0:
            return
        xb, yb = x.to(self.cxx.device, torch.float32), y.to(self.cxx.device, torch.float32)
        if weights is not None:
            w = weights.to(self.cxx.device, torch.float32).reshape(-1)
            if w.numel() != nb or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise ValueError(f"weights must be {nb} finite values >= 0, got shape {list(weights.shape)}")
            total = float(w.double().sum())
            if total <= 0:
                return
            mx, my = (w @ xb) / total, (w @ yb) / total
            xc, yc = xb - mx, yb - my
            xw, yw = xc * w.unsqueeze(1), yc * w.unsqueeze(1)
            self._merge(total, mx.double(), my.double(), xw.T @ xc, xw.T @ yc, (yw * yc).sum(0))
            return
        mx, my = xb.mean(0), yb.mean(0)
        xc, yc = xb - mx, yb - my
        self._merge(nb, mx.double(), my.double(), xc.T @ xc, xc.T @ yc, (yc * yc).sum(0))  # [P,P] [P,Q] [Q]

    def merge(self, other: MomentStats) -> None:
        """Add another accumulator's rows (e.g. from another device or shard)."""
        if (other.n_x, other.n_y) != (self.n_x, self.n_y):
            raise ValueError(
                f"cannot merge statistics of widths {other.n_x, other.n_y} into {self.n_x, self.n_y}"
            )
        if other.n:
            self._merge(other.n, other.mean_x, other.mean_y, other.cxx, other.cxy, other.syy)

    def _merge(self, nb, mx, my, cxx, cxy, syy) -> None:
        if self.n == 0:
            self.n, self.mean_x, self.mean_y = nb, mx.clone(), my.clone()
            self.cxx, self.cxy, self.syy = cxx.clone(), cxy.clone(), syy.clone()
            return
        n = self.n + nb
        dx, dy = mx - self.mean_x, my - self.mean_y
        f = self.n * nb / n
        self.cxx += cxx + (f * torch.outer(dx, dx)).float()
        self.cxy += cxy + (f * torch.outer(dx, dy)).float()
        self.syy += syy + (f * dy * dy).float()
        self.mean_x += dx * (nb / n)
        self.mean_y += dy * (nb / n)
        self.n = n


def solve_ridge(cxx: torch.Tensor, cxy: torch.Tensor, alpha: float) -> torch.Tensor:
    """W = (Cxx + alpha I)⁻¹ Cxy in fp64: [P, P], [P, Q] -> [P, Q] fp64.

    Cholesky first; when the penalised Gram is not numerically positive definite (alpha 0 on collinear
    inputs), a symmetric eigen-solve that drops directions below fp64 noise.
    """
    a = cxx.double() + alpha * torch.eye(cxx.size(0), dtype=torch.float64, device=cxx.device)
    b = cxy.double()
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, chol)
    evals, evecs = torch.linalg.eigh(a)
    keep = evals > evals.abs().max() * a.size(0) * torch.finfo(torch.float64).eps
    inv = torch.where(keep, 1.0 / evals.where(keep, torch.ones_like(evals)), torch.zeros_like(evals))
    return evecs @ (inv.unsqueeze(1) * (evecs.T @ b))


def r2_from_stats(
    stats: MomentStats,
    coef: torch.Tensor,
    intercept: torch.Tensor,
    x_index: torch.Tensor | None = None,
    y_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """R² of a fitted map on the rows summarised by `stats` (held-out rows: a second accumulator).

    Args:
        coef: [Q', P'] and intercept [Q'] of the map; x_index [P'] / y_index [Q'] pick the statistics'
            columns it reads and predicts (all when None).

    Returns:
        per-output R² fp64 [Q'], and the variance-weighted R² over all outputs (1 - ΣSSE / ΣSST).
    """
    dev = stats.cxx.device
    xi = torch.arange(stats.n_x, device=dev) if x_index is None else x_index.to(dev)
    yi = torch.arange(stats.n_y, device=dev) if y_index is None else y_index.to(dev)
    w = coef.double().T.to(dev)  # [P', Q']
    cxx = stats.cxx[xi][:, xi].double()
    cxy = stats.cxy[xi][:, yi].double()
    syy = stats.syy[yi].double()
    # residual e = (y - ȳ) - (x - x̄)W + c, with c the offset of the map's prediction at the stats' means
    c = stats.mean_y[yi] - stats.mean_x[xi] @ w - intercept.double().to(w.device)
    sse = syy - 2 * (w * cxy).sum(0) + (w * (cxx @ w)).sum(0) + stats.n * c * c
    sst = syy.clamp_min(torch.finfo(torch.float64).tiny)
    return 1 - sse / sst, float(1 - sse.sum() / sst.sum())


class RidgeMapper:
    """Ridge regression Y ≈ X Wᵀ + b from sufficient statistics; the intercept is not penalised.

    Args:
        alpha: the penalty; with relative_alpha, a fraction of the mean diagonal of the centred Gram
            (mean per-feature sum of squares), so one setting means the same across widths and row counts.
        relative_alpha: scale alpha as above (True) or use it as is (False, scikit-learn's meaning).
        fit_intercept: centre x and y (True) or fit through the origin.
    """

    def __init__(self, alpha: float = 1e-2, *, relative_alpha: bool = True, fit_intercept: bool = True):
        self.alpha = alpha
        self.relative_alpha = relative_alpha
        self.fit_intercept = fit_intercept

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> Self:
        """Fit on rows x [N, P], y [N, Q] (one batch of statistics)."""
        stats = MomentStats(x.size(1), y.size(1), x.device)
        stats.update(x, y)
        return self.fit_stats(stats)

    def fit_stats(
        self, stats: MomentStats, x_index: torch.Tensor | None = None, y_index: torch.Tensor | None = None
    ) -> Self:
        """Fit from accumulated statistics, optionally on a sub-block of their columns.

        Args:
            x_index: [P'] int64 input columns to use (e.g. the selected sender layers); all when None.
            y_index: [Q'] int64 output columns; all when None.

        Raises:
            ValueError: alpha < 0, or no rows.
        """
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if stats.n == 0:
            raise ValueError("cannot fit ridge on zero rows")
        dev = stats.cxx.device
        xi = torch.arange(stats.n_x, device=dev) if x_index is None else x_index.to(dev)
        yi = torch.arange(stats.n_y, device=dev) if y_index is None else y_index.to(dev)
        cxx = stats.cxx[xi][:, xi].double()
        cxy = stats.cxy[xi][:, yi].double()
        mx, my = stats.mean_x[xi], stats.mean_y[yi]
        if not self.fit_intercept:
            cxx = cxx + stats.n * torch.outer(mx, mx)
            cxy = cxy + stats.n * torch.outer(mx, my)
        scale = float(cxx.diagonal().mean()) if self.relative_alpha else 1.0
        self.alpha_ = self.alpha * scale
        w = solve_ridge(cxx, cxy, self.alpha_)  # [P', Q'] fp64
        b = my - mx @ w if self.fit_intercept else torch.zeros_like(my)
        self.coef_ = w.T.float().contiguous()
        self.intercept_ = b.float()
        self.n_features_in_ = int(xi.numel())
        self.n_samples_seen_ = stats.n
        return self

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., P] -> fp32 [..., Q] (fp32 accumulation)."""
        return x.float() @ self.coef_.to(x.device).T + self.intercept_.to(x.device)


class SklearnRidgeMapper:
    """The same estimator through `sklearn.linear_model.Ridge(solver="cholesky")` on full rows (fp64).

    Same hyperparameters and fitted attributes as `RidgeMapper`; a slow twin for tests and small pairs.
    """

    def __init__(self, alpha: float = 1e-2, *, relative_alpha: bool = True, fit_intercept: bool = True):
        self.alpha = alpha
        self.relative_alpha = relative_alpha
        self.fit_intercept = fit_intercept

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> Self:
        from sklearn.linear_model import Ridge

        xn, yn = x.double().cpu().numpy(), y.double().cpu().numpy()
        scale = 1.0
        if self.relative_alpha:
            xc = xn - xn.mean(0) if self.fit_intercept else xn
            scale = float(np.mean(np.sum(xc * xc, axis=0)))
        self.alpha_ = self.alpha * scale
        model = Ridge(alpha=self.alpha_, fit_intercept=self.fit_intercept, solver="cholesky").fit(xn, yn)
        self.coef_ = torch.from_numpy(np.atleast_2d(model.coef_)).float()
        intercept = np.atleast_1d(np.asarray(model.intercept_, dtype=np.float64))
        self.intercept_ = torch.from_numpy(intercept).float()
        if not self.fit_intercept:
            self.intercept_ = torch.zeros(self.coef_.size(0))
        self.n_features_in_ = xn.shape[1]
        return self

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.coef_.to(x.device).T + self.intercept_.to(x.device)
