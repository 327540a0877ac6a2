"""benchmarks.bench_service end to end on the smallest settings: every part runs (the replay, the no-op
sweeps, the anchors and a short real-model load under both schedulers) and the JSON carries issue 11's
headline keys. Slow: about a minute and a half on the 2-core VM (the 64-session sweep is fixed)."""

from __future__ import annotations

import json
import os

import pytest

import benchmarks.bench_service as bench

HEADLINE = (
    "turns_per_s_c64_noop", "p99_ms_c64_noop", "p50_ms_c1_noop", "anchor_calls_per_s_c64",
    "anchor_turn_floor_ms_c1", "turns_per_s_c64_model", "baseline_turns_per_s_c64_model", "p99_ms_c64_model",
    "engine_ttft_p99_ms_c64_model", "decode_tokens_per_s_c1_model", "decode_tokens_per_s_c64_model",
    "numerics_profile",
)  # fmt: skip


@pytest.mark.slow
def test_main_runs_every_part_and_writes_the_headline(tmp_path, capsys) -> None:
    path = tmp_path / "service.json"
    before = os.sched_getaffinity(0)
    rc = bench.main(["--turns", "4", "--overhead-turns", "2", "--model-load", "--model-sessions", "2",
                     "--model-turns", "2", "--load-rounds", "2", "--json", str(path)])  # fmt: skip
    assert rc in (0, None)
    doc = json.loads(path.read_text())
    for key in HEADLINE:
        assert doc[key] is not None, key
    # a turn of 4 tokens streams its plan, 1 to 4 token chunks and its stats
    for sessions, costs in doc["per_turn_costs"].items():
        assert 3 <= costs["stream_messages_per_turn"] <= 6, sessions
    # the label names the cpu path the served models computed under, never "auto"
    assert "cpu=auto" not in doc["numerics_profile"] and "cpu=" in doc["numerics_profile"]
    assert doc["model_load"]["c64_serial"]["scheduler"] == "serial"
    # the headline runs place the models as a node does by default; the other placement runs beside them
    placements = {name: run["model_process"] for name, run in doc["model_load"].items()}
    assert placements["c64_batching"] == placements["c64_serial"] == bench.DEFAULT_MODEL_PROCESS
    assert placements[f"c64_batching_{bench.OTHER_MODEL_PROCESS}"] == bench.OTHER_MODEL_PROCESS
    assert doc["model_load"]["c64_batching"]["turns"] == 4
    # the three arms the ratios divide ran twice in turn: each reports its median round (of two, the
    # faster), and each round's ratios come from that round's own arms
    rounds = {name: doc["model_load"][name] for name in ("c64_batching", "c64_serial", "c1_batching")}
    for name, run in rounds.items():
        assert len(run["rounds_decode_tokens_per_s"]) == 2, name
        assert run["decode_tokens_per_s"] == max(run["rounds_decode_tokens_per_s"]), name
    batched = rounds["c64_batching"]["rounds_turns_per_s"]
    baseline = rounds["c64_serial"]["rounds_turns_per_s"]
    assert doc["load_rounds"]["model_ratio"] == [b / s for b, s in zip(batched, baseline, strict=True)]
    decoded = rounds["c64_batching"]["rounds_decode_tokens_per_s"]
    alone = rounds["c1_batching"]["rounds_decode_tokens_per_s"]
    assert doc["load_rounds"]["decode_ratio"] == [b / o for b, o in zip(decoded, alone, strict=True)]
    # round 1 runs the three arms in the reverse order of round 0 (the VM's drift meets both sides)
    order = [line.split(" (round ")[0].removeprefix("model load ")
             for line in capsys.readouterr().err.splitlines() if line.startswith("model load ")]  # fmt: skip
    assert order[:6] == ["c64_batching", "c64_serial", "c1_batching", "c1_batching", "c64_serial",
                         "c64_batching"], order  # fmt: skip
    # the side arms run once
    assert "rounds_turns_per_s" not in doc["model_load"][f"c64_batching_{bench.OTHER_MODEL_PROCESS}"]
    # one session's short run: the median of its repeats
    one = doc["model_load"]["c1_batching"]
    repeats = one["repeats_decode_tokens_per_s"]
    assert len(repeats) == bench.ONE_SESSION_REPEATS and repeats == sorted(repeats)
    assert one["decode_tokens_per_s"] == repeats[len(repeats) // 2] and one["turns"] == 2
    # the default runs split the CPUs as `kvresume serve` does (where there are two to split); the
    # unpinned arm runs beside them
    if len(os.sched_getaffinity(0)) >= 2 and bench.DEFAULT_MODEL_PROCESS == "separate":
        for name in ("c64_batching", "c64_serial", "c1_batching"):
            run = doc["model_load"][name]
            assert run["model_process_cpus"] and run["service_cpus"], name
            assert not set(run["model_process_cpus"]) & set(run["service_cpus"]), name
        unpinned = doc["model_load"]["c64_batching_unpinned"]
        assert unpinned["model_process_cpus"] is None and unpinned["turns"] == 4
    # and leave this process on every CPU it had
    assert os.sched_getaffinity(0) == before
    # the batching run's steps, measured from the scheduler's metrics; the serial baseline runs none
    batching, serial = doc["model_load"]["c64_batching"], doc["model_load"]["c64_serial"]
    assert batching["steps"] > 0 and batching["decodes_per_step"] >= 1
    # one thread runs a step, so its CPU time never exceeds the step's wall time
    assert batching["step_cpu_ms_per_turn"] > 0 and batching["step_wall_over_cpu"] >= 0.95
    assert serial["steps"] == 0 and serial["step_wall_over_cpu"] is None
    # which process bounds a run: this one's CPU per turn, and the model process's in all and by operation
    for name, run in doc["model_load"].items():
        assert run["service_cpu_ms_per_turn"] > 0, name
        if run["model_process"] == "separate":
            ops = run["model_ops_cpu_ms_per_turn"]
            assert run["model_process_busy"] > 0, name
            if run["model_process_cpus"] and len(run["model_process_cpus"]) == 1:
                # pinned to one CPU: its CPU over the wall is the share of the run it computed
                assert run["model_process_busy"] <= 1.05, name
            assert run["model_process_cpu_ms_per_turn"] >= sum(ops.values()) * 0.9, name
            assert "decode_many" in ops or "decode" in ops, name
        else:
            assert run["model_process_cpu_ms_per_turn"] is None, name
    # both gRPC servers side by side: the headline's sweeps are the default server's
    assert set(doc["overhead_by_grpc_server"]) == {"threads", "async"}
    assert {s["grpc_server"] for s in doc["overhead"]} == {doc["grpc_server"]}
    (other,) = {"threads", "async"} - {doc["grpc_server"]}
    assert doc["model_load"][f"c64_batching_{other}"]["grpc_server"] == other
    assert doc["model_load"]["c64_batching"]["grpc_server"] == doc["grpc_server"]
    # the asyncio server keeps its small pool at every concurrency; the thread-pool server a thread a stream
    assert {s["grpc_workers"] for s in doc["overhead_by_grpc_server"]["async"]} == {bench.ASYNC_POOL_WORKERS}
    assert [s["grpc_workers"] for s in doc["overhead_by_grpc_server"]["threads"]] == [8, 8, 64]
    # the stand-in keeps its turn ends as the real model does: every full hit after a session's first
    # turn is served from kept state, its chunks unread (2 of a sweep's 3 turns per session)
    for sweep in doc["overhead"]:
        assert sweep["paths"] == {"FULL_HIT": sweep["turns_measured"]}
        # one session at a time runs several sessions in turn (a p50 of more than 2 samples)
        rounds = bench.SEQUENTIAL_SESSIONS_C1 if sweep["concurrency"] == 1 else 1
        assert sweep["sessions"] == sweep["concurrency"] * rounds
        assert sweep["turns_measured"] == sweep["sessions"] * 2
        assert sweep["kept_state_hits_per_turn"] == pytest.approx(2 / 3)
        assert sweep["unread_chunk_hits_per_turn"] > 0
        # one commit a turn and one a session (its creation), wherever the turn's finish ran (the
        # registry writer process's commits counted too, when there is one)
        assert sweep["sql_commits_per_turn"] == pytest.approx(4 / 3)
        if sweep["concurrency"] > 1:
            # with several sessions at once the finishes run in the registry writer process (the default)
            assert sweep["sql_commits_in_writer_process_per_turn"] > 0
            # the measured turns' own wall: the sessions' creation and first turns came before it
            assert sweep["setup_s"] > 0 and sweep["turns_per_s"] > sweep["turns_per_s_with_setup"]
