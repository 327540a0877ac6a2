"""benchmarks.bench_turn_anatomy: a tiny run of its code path (the lone turn against its floor, the CPU by
thread, the WAL frames, one probe's two arms), not its figures; and every probe's wrapped functions still
exist where it wraps them (a renamed one would leave the probe measuring nothing)."""

from __future__ import annotations

import json
import sys

import pytest

import benchmarks.bench_turn_anatomy as bench
import orchestrator.api.turn_runner as turn_runner
import orchestrator.engine.turn_engine as turn_engine
from storage import GlobalKVStore


def test_main_measures_the_lone_turn_and_a_probe(tmp_path, monkeypatch) -> None:
    # the entry point sends structlog to the sys.stderr of the moment (pytest's capture, closed after
    # this test): the process's logging stays as the suite configured it
    monkeypatch.setattr(bench, "logs_to_stderr", lambda: None)
    path = tmp_path / "anatomy.json"
    argv = ["--turns", "6", "--probe-turns", "8", "--probes", "store_sync_overlapped", "--anchor-calls", "4"]
    assert bench.main([*argv, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    turn = doc["turn"]
    assert doc["p50_ms_c1_noop"] == turn["p50_ms"] > 0
    assert doc["ratio_to_floor"] == pytest.approx(turn["p50_ms"] / doc["anchor_turn_floor_ms_c1"])
    assert turn["cpu_ms_per_turn"] > 0 and turn["wal_frames_per_turn"] > 1
    if sys.platform == "linux":
        # the turn runs on a gRPC handler thread, which spends CPU on every turn
        assert turn["by_thread"]["grpc_handler"]["cpu_ms"] > 0
    [probe] = doc["probes"]
    assert probe["probe"] == "store_sync_overlapped" and probe["turns_per_arm"] == 4
    assert probe["b_minus_a_ms"] == pytest.approx(probe["p50_ms_b"] - probe["p50_ms_a"])


@pytest.mark.parametrize("name", bench.PROBES)
def test_probe_wraps_what_exists_and_restores_it(name) -> None:
    wrapped = (
        (GlobalKVStore, "_sync_wal"),
        (GlobalKVStore, "_settle_ticket"),
        (turn_engine, "write_finish"),
        (turn_runner, "_report"),
    )
    before = [getattr(owner, attr) for owner, attr in wrapped]
    interval = sys.getswitchinterval()
    toggle = bench._Toggle()
    with bench._probe(name, toggle) as before_turn:
        toggle.on = True
        before_turn()
    assert [getattr(owner, attr) for owner, attr in wrapped] == before
    assert sys.getswitchinterval() == interval


def test_unknown_probe_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--probes", "no_such_probe"])
