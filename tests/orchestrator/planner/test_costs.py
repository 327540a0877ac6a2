"""CostTable artifact round trip and validation; per_token_seconds fits a slope on a scripted clock."""

from __future__ import annotations

import json

import pytest

from orchestrator.planner import BUILTIN_COSTS, Costs, CostTable
from orchestrator.planner.calibration import measure_costs, per_token_seconds


def test_cost_table_save_load_round_trip(tmp_path) -> None:
    table = CostTable().with_model(
        "small", Costs(load_s=1e-6, encode_s=3e-4, decode_replay_s=2e-4, map_s=0.0)
    )
    path = tmp_path / "costs.json"
    table.save(path)
    loaded = CostTable.load(path)
    assert loaded.for_model("small").encode_s == 3e-4
    assert loaded.for_model("small").source == str(path)
    assert loaded.for_model("never-calibrated").encode_s == BUILTIN_COSTS.encode_s


def test_cost_table_load_rejects_unknown_keys_and_versions(tmp_path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(
        json.dumps(
            {
                "format": "kvresume.costs",
                "version": 1,
                "models": {
                    "small": {"load_s": 1, "encode_s": 1, "decode_replay_s": 1, "map_s": 1, "warp_s": 2}
                },
            }
        )
    )
    with pytest.raises(ValueError, match="unknown cost keys \\['warp_s'\\]"):
        CostTable.load(path)
    path.write_text(json.dumps({"format": "kvresume.costs", "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        CostTable.load(path)


def test_costs_rejects_negative_figures() -> None:
    with pytest.raises(ValueError, match="encode_s=-1"):
        Costs(load_s=0, encode_s=-1, decode_replay_s=0, map_s=0)


def test_per_token_seconds_fits_the_slope() -> None:
    # A scripted clock: each call of work(n) takes 0.5 s fixed + 0.01 s per token.
    now = [0.0]

    def work(n: int) -> None:
        now[0] += 0.5 + 0.01 * n

    slope = per_token_seconds(work, [10, 20, 40], repeats=2, clock=lambda: now[0])
    assert slope == pytest.approx(0.01)
    with pytest.raises(ValueError, match="two or more distinct"):
        per_token_seconds(work, [10, 10])


def test_measure_costs_orders_real_work() -> None:
    # Real timing on cheap work: a loop 100x longer per token must measure as costlier per token.
    def light(n: int) -> None:
        sum(range(n))

    def heavy(n: int) -> None:
        sum(range(n * 100))

    costs = measure_costs(encode=heavy, load=light, decode_replay=heavy, sizes=(2000, 4000, 8000), repeats=3)
    assert costs.encode_s > costs.load_s
    assert costs.map_s == 0.0
