"""Weighted moments (attention-weighted calibration): the streamed, merged weighted ridge against
scikit-learn's Ridge with sample_weight on the full rows, and the receiver's attention mass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mappers import MomentStats, RidgeMapper, r2_from_stats
from model import Transformer, attention_mass, init_random, load_preset


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_streamed_ridge_matches_sklearn_sample_weight(seed: int) -> None:
    from sklearn.linear_model import Ridge

    g = torch.Generator().manual_seed(seed)
    n, p, q = 300, 7, 3
    x = torch.randn(n, p, generator=g) * 2 + 1
    y = x @ torch.randn(p, q, generator=g) + 0.3 * torch.randn(n, q, generator=g) + 5
    w = torch.rand(n, generator=g) ** 3 * 10  # heavy-tailed, like attention mass
    stats = MomentStats(p, q)
    for a in range(0, n, 70):  # several batches merged
        stats.update(x[a : a + 70], y[a : a + 70], w[a : a + 70])
    fit = RidgeMapper(0.5, relative_alpha=False).fit_stats(stats)
    ref = Ridge(alpha=0.5, solver="cholesky")
    ref.fit(x.double().numpy(), y.double().numpy(), sample_weight=w.numpy())
    np.testing.assert_allclose(fit.coef_.numpy(), ref.coef_, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fit.intercept_.numpy(), ref.intercept_, rtol=1e-4, atol=1e-4)
    # weighted R² from the moments equals the weighted R² of the rows
    pred = fit.predict(x)
    mean = (w @ y) / w.sum()
    r2_rows = 1 - float((w[:, None] * (pred - y) ** 2).sum() / (w[:, None] * (y - mean) ** 2).sum())
    assert r2_from_stats(stats, fit.coef_, fit.intercept_)[1] == pytest.approx(r2_rows, abs=1e-4)
    # unit weights are the unweighted statistics
    plain, unit = MomentStats(p, q), MomentStats(p, q)
    plain.update(x, y)
    unit.update(x, y, torch.ones(n))
    torch.testing.assert_close(unit.cxy, plain.cxy, rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="weights"):
        stats.update(x[:4], y[:4], torch.tensor([1.0, -1.0, 1.0, 1.0]))


def test_attention_mass_covers_every_source_and_sums_to_the_reads() -> None:
    torch.manual_seed(0)
    model = init_random(Transformer(load_preset("v41-tiny")), seed=2).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        mass = attention_mass(model, tokens)
    assert sorted(mass) == sorted(model.cfg.kv_source_layers)
    for layer, m in mass.items():
        ratio = model.cfg.compress_ratios[layer]
        assert m.shape == (2, 48 // ratio) and bool((m >= 0).all()) and float(m.sum()) > 0
        # each query's probabilities sum to at most 1 per head and layer reading the source
        readers = [i for i in range(model.cfg.n_layers) if model.cfg.kv_source_of(i) == layer
                   and model.cfg.compress_ratios[i]]
        heads = model.cfg.n_heads
        assert float(m.sum(-1).max()) <= 48 * heads * len(readers) + 1e-3
