"""RidgeMapper (streamed fp32 moments, fp64 Cholesky) against its scikit-learn twin, held-out R² from moments
against R² from rows, and the solver's fallback on a singular Gram."""

from __future__ import annotations

import pytest
import torch

from mappers import MomentStats, RidgeMapper, SklearnRidgeMapper, r2_from_stats


def _data(n: int, p: int, q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # correlated inputs with a non-zero mean, as stacked KV layers are
    mix = torch.randn(p, p, generator=g) / p**0.5 + torch.eye(p)
    x = torch.randn(n, p, generator=g) @ mix + 3.0
    w = torch.randn(p, q, generator=g)
    y = x @ w + 0.3 * torch.randn(n, q, generator=g) - 1.5
    return x, y


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= rel, f"{what}: max relative difference {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize(
    ("alpha", "relative", "intercept"),
    [(1e-2, True, True), (5.0, False, True), (1e-3, True, False)],
    ids=["relative", "absolute", "no-intercept"],
)
def test_ridge_mapper_matches_sklearn_twin(alpha: float, relative: bool, intercept: bool) -> None:
    x, y = _data(1000, 63, 17, seed=0)
    stats = MomentStats(63, 17)
    # odd batch sizes exercise Chan's merge, including a single row
    for a, b in [(0, 1), (1, 64), (64, 401), (401, 1000)]:
        stats.update(x[a:b], y[a:b])
    ours = RidgeMapper(alpha, relative_alpha=relative, fit_intercept=intercept).fit_stats(stats)
    twin = SklearnRidgeMapper(alpha, relative_alpha=relative, fit_intercept=intercept).fit(x, y)
    assert ours.coef_.shape == twin.coef_.shape == (17, 63)
    assert abs(ours.alpha_ - twin.alpha_) <= 1e-5 * twin.alpha_
    assert_close_rel(ours.coef_, twin.coef_, 1e-5, "coef_")
    if intercept:
        # b = ȳ - x̄W sums 63 terms of size |x̄||W| to a smaller value (inputs centred far from 0), so its
        # error is relative to those terms, not to b itself
        terms = float((x.mean(0).abs() @ twin.coef_.abs().T).max())
        err = float((ours.intercept_ - twin.intercept_).abs().max())
        assert err <= 1e-5 * terms, f"intercept_: max difference {err:.2e} > 1e-5 * {terms:.1f}"
    assert_close_rel(ours.predict(x[:50]), twin.predict(x[:50]), 1e-5, "predict")


def test_ridge_mapper_fit_stats_on_column_blocks() -> None:
    x, y = _data(400, 40, 12, seed=1)
    stats = MomentStats(40, 12)
    stats.update(x, y)
    xi, yi = torch.tensor([3, 5, 7, 20, 39]), torch.tensor([0, 11])
    block = RidgeMapper(0.1).fit_stats(stats, xi, yi)
    direct = SklearnRidgeMapper(0.1).fit(x[:, xi], y[:, yi])
    assert_close_rel(block.coef_, direct.coef_, 1e-5, "block coef_")


def test_r2_from_stats_matches_rows() -> None:
    x, y = _data(800, 30, 9, seed=2)
    fit = RidgeMapper(1e-2).fit(x[:500], y[:500])
    held = MomentStats(30, 9)
    held.update(x[500:650], y[500:650])
    held.update(x[650:], y[650:])
    per, total = r2_from_stats(held, fit.coef_, fit.intercept_)
    pred, truth = fit.predict(x[500:]).double(), y[500:].double()
    sse = ((truth - pred) ** 2).sum(0)
    sst = ((truth - truth.mean(0)) ** 2).sum(0)
    assert_close_rel(per, 1 - sse / sst, 1e-4, "per-output R²")
    assert abs(total - float(1 - sse.sum() / sst.sum())) < 1e-4
    assert 0.5 < total < 1.0


def test_ridge_mapper_singular_gram_falls_back() -> None:
    x, y = _data(200, 10, 3, seed=3)
    dup = torch.cat([x, x[:, :4]], dim=1)  # exactly collinear columns: Cholesky of Cxx alone fails
    fit = RidgeMapper(0.0, relative_alpha=False).fit(dup, y)
    assert torch.isfinite(fit.coef_).all()
    assert float(((fit.predict(dup) - y) ** 2).mean()) < 0.2


def test_moment_stats_rejects_bad_shapes() -> None:
    stats = MomentStats(4, 2)
    with pytest.raises(ValueError, match="widths 3, 2"):
        stats.update(torch.zeros(5, 3), torch.zeros(5, 2))
    with pytest.raises(ValueError, match="same N"):
        stats.update(torch.zeros(5, 4), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="zero rows"):
        RidgeMapper().fit_stats(stats)
