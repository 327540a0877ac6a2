"""The A/B load benchmark's summary (benchmarks/bench_ab_load.py): each pair's ratio of this tree's figure
over the base's, their median and mean, and figures that an arm lacks left out; and one tiny `--noop` arm
(the no-op sweeps in a child process of the tree). The model-load runs take minutes and are not part of
any suite."""

from __future__ import annotations

import pytest

from benchmarks.bench_ab_load import summarize


def test_the_summary_is_each_pairs_ratio_then_their_median_and_mean() -> None:
    pairs = [
        ({"turns_per_s": 100.0, "model_ms": 8.0}, {"turns_per_s": 110.0, "model_ms": 7.0}),
        ({"turns_per_s": 120.0, "model_ms": 8.0}, {"turns_per_s": 114.0, "model_ms": 8.0}),
        ({"turns_per_s": 90.0, "model_ms": 10.0}, {"turns_per_s": 108.0, "model_ms": 9.0}),
    ]
    s = summarize(pairs)
    assert s["turns_per_s"]["ratios"] == pytest.approx([1.1, 0.95, 1.2])
    assert s["turns_per_s"]["median_ratio"] == pytest.approx(1.1)
    assert s["turns_per_s"]["mean_ratio"] == pytest.approx((1.1 + 0.95 + 1.2) / 3)
    assert s["model_ms"]["median_ratio"] == pytest.approx(0.9)


def test_a_figure_one_arm_lacks_is_left_out_and_no_pairs_is_an_error() -> None:
    pairs = [
        ({"turns_per_s": 100.0, "model_ms": None}, {"turns_per_s": 105.0, "model_ms": 7.0}),
        ({"turns_per_s": 100.0, "model_ms": 8.0}, {"turns_per_s": 95.0, "model_ms": None}),
    ]
    s = summarize(pairs)
    assert set(s) == {"turns_per_s"}
    assert s["turns_per_s"]["ratios"] == pytest.approx([1.05, 0.95])
    with pytest.raises(ValueError, match="no pairs"):
        summarize([])


def test_a_noop_arm_runs_the_sweeps_from_its_tree() -> None:
    # the child process imports the arm's own tree and runs `bench_service.overhead` there (2 sessions x
    # 2 turns, then the one-session sweep): the figures `--noop` compares
    from benchmarks.bench_ab_load import _NOOP_KEYS, REPO, run_arm
    from orchestrator.numerics_env import resolve_cpu_path

    got = run_arm(REPO, {"sessions": 2, "turns": 2, "cpu_path": resolve_cpu_path("auto")}, noop=True)
    assert set(got) == set(_NOOP_KEYS)
    assert all(isinstance(got[k], float) and got[k] > 0 for k in _NOOP_KEYS), got


def test_the_pairs_alternate_which_arm_runs_first() -> None:
    from benchmarks.bench_ab_load import run_order

    assert [run_order(i) for i in (1, 2, 3, 4)] == [
        ("base", "this"),
        ("this", "base"),
        ("base", "this"),
        ("this", "base"),
    ]


def test_the_service_cost_over_the_model_cost_of_an_arm() -> None:
    from benchmarks.bench_ab_load import with_svc_over_model

    arm = {"turns_per_s": 100.0, "service_cpu_ms_per_turn": 5.0, "model_process_cpu_ms_per_turn": 8.0}
    assert with_svc_over_model(arm) == {**arm, "svc_over_model": pytest.approx(0.625)}
    # an arm without a model process (or its figure) has none
    assert with_svc_over_model({"service_cpu_ms_per_turn": 5.0})["svc_over_model"] is None
    assert with_svc_over_model({**arm, "model_process_cpu_ms_per_turn": None})["svc_over_model"] is None


def test_model_busy_is_the_model_process_cpu_over_the_wall() -> None:
    from benchmarks.bench_ab_load import with_model_busy

    arm = {"turns_per_s": 125.0, "model_process_cpu_ms_per_turn": 7.6}
    assert with_model_busy(arm) == {**arm, "model_busy": pytest.approx(0.95)}
    assert with_model_busy({"turns_per_s": 125.0})["model_busy"] is None
    assert with_model_busy({**arm, "turns_per_s": None})["model_busy"] is None
