"""Multi-turn drift (mappers/drift.py): the switching session's bookkeeping on small random models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mappers import identity_mapper
from mappers.drift import DriftReport, measure_drift
from model import Transformer, init_random, load_preset


def test_drift_session_alternates_models_and_turn_zero_is_unmapped() -> None:
    torch.set_num_threads(1)
    cfg = load_preset("v41-tiny")
    models = {n: init_random(Transformer(cfg), seed=i).eval() for i, n in enumerate("ab")}
    ident = identity_mapper(cfg, cfg)
    mappers = {("a", "b"): ident, ("b", "a"): ident}
    g = torch.Generator().manual_seed(3)
    # two sessions of 88 history tokens, 3 turns: small enough for the default suite (the 3 x 120 x 4
    # version took 62 s on 2 loaded cores)
    tokens = torch.randint(0, cfg.vocab_size, (2, 96), generator=g)
    answers = [(92, 94)] * 2
    report = measure_drift(mappers, models, ("a", "b"), tokens, answers, suffix_tokens=8, turns=3,
                           turn_tokens=16)
    assert report.models == ("a", "b", "a")
    assert report.mapped.shape == report.own.shape == (2, 3)
    assert report.first_tokens == 88 - 2 * 16
    # turn 0 runs the first model on its own prefill in both columns
    assert np.array_equal(report.mapped[:, 0], report.own[:, 0])
    rows = report.per_turn(n_boot=50)
    assert [r["turn"] for r in rows] == [0, 1, 2] and [r["model"] for r in rows] == ["a", "b", "a"]
    with pytest.raises(ValueError, match="cannot hold"):
        measure_drift(mappers, models, ("a", "b"), tokens, answers, suffix_tokens=8, turns=10, turn_tokens=16)
    with pytest.raises(ValueError, match="no mapper"):
        measure_drift({("a", "b"): ident}, models, ("a", "b"), tokens, answers, suffix_tokens=8, turns=2)


def test_drift_slope_is_the_least_squares_slope_of_per_turn_retention() -> None:
    rng = np.random.default_rng(0)
    own = np.ones((200, 5), dtype=np.int64)
    # retention falling by 0.05 per turn
    mapped = (rng.random((200, 5)) < (0.95 - 0.05 * np.arange(5))).astype(np.int64)
    names = ("a", "b") * 2 + ("a",)
    report = DriftReport(models=names, mapped=mapped, own=own, turn_tokens=1, first_tokens=1)
    slope, lo, hi = report.slope(n_boot=300)
    direct = np.polyfit(np.arange(5), mapped.mean(0), 1)[0]
    assert slope == pytest.approx(direct) and lo <= slope <= hi
    assert -0.08 < slope < -0.02 and hi < 0
