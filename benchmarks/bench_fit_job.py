"""Do mapper fitting jobs starve the turns being served? Turn latency on a node with no job, with a job
under the default thread cap (fit_threads=1), and with an uncapped one (fit_threads = every core).

One in-process node serves the shipped v41-sib-s and v41-sib-l over real gRPC; the serving process uses
`--serve-threads` torch threads (default: the cores the cap leaves, at least 1). Each condition runs R
turns, each a fresh session's cold prefill of P tokens plus N generated tokens, sequentially: client wall
time per turn and the engine's TTFT. While a job condition runs, a StartFit job (v41-sib-s ->
v41-sib-l, random corpus, a budget large enough to outlast the turns) is in RUNNING with rows arriving;
its fitting rate (calibration tokens per second, from the job's own progress) is reported too, then it is
cancelled. Ratios are against the no-job condition measured in the same process.

Run: python -m benchmarks.bench_fit_job [--turns 12] [--prompt-tokens 512] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from orchestrator.api import build_server
from orchestrator.engine import ModelRegistry, ServedModelSpec, build_node, repo_root
from orchestrator.settings import Settings

S, L = "v41-sib-s", "v41-sib-l"
TENANT, TOKEN, ADMIN = "bench", "tok-bench", "tok-admin"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _turns(stubs: Any, channel: grpc.Channel, n: int, prompt_tokens: int, new_tokens: int,
           seed: int) -> dict[str, list[float]]:
    sessions = stubs.sessions_grpc.SessionsStub(channel)
    md = (("authorization", f"Bearer {TOKEN}"),)
    rng = random.Random(seed)
    wall, ttft = [], []
    for _ in range(n):
        created = sessions.CreateSession(stubs.sessions.CreateSessionRequest(model=S), metadata=md)
        sid = created.session.session_id
        ids = [rng.randrange(16, 4096) for _ in range(prompt_tokens)]
        request = stubs.sessions.TurnRequest(
            session_id=sid, tokens=stubs.sessions.TokenIds(ids=ids),
            generation=stubs.sessions.GenerationParams(max_new_tokens=new_tokens),
        )
        t0 = time.perf_counter()
        stats = None
        for event in sessions.Turn(request, metadata=md):
            if event.WhichOneof("event") == "stats":
                stats = event.stats
        wall.append(time.perf_counter() - t0)
        assert stats is not None
        ttft.append(stats.ttft_s)
    return {"wall_s": wall, "ttft_s": ttft}


def _condition(data_dir: Path, *, fit_threads: int | None, serve_threads: int, turns: int,
               prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    ckpt = repo_root() / "checkpoints"
    registry = ModelRegistry({n: ServedModelSpec(name=n, checkpoint=ckpt / n) for n in (S, L)})
    settings = Settings(
        data_dir=data_dir, database_url=f"sqlite:///{data_dir / 'registry.sqlite3'}",
        tenant_tokens={TENANT: TOKEN}, admin_token=ADMIN, grpc_port=0, metrics_enabled=False,
        kv_chunk_tokens=32, fit_threads=fit_threads or 1, fit_max_budget_tokens=50_000_000,
    )
    torch.set_num_threads(serve_threads)
    service = build_node(settings, registry=registry, preload=True)
    server = build_server(service.ctx, host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stubs = service.ctx.stubs
    mappers = stubs.mappers_grpc.MappersStub(channel)
    admin_md = (("authorization", f"Bearer {ADMIN}"),)
    pb = stubs.mappers
    job_id, rate = None, None
    try:
        _turns(stubs, channel, 2, prompt_tokens, new_tokens, seed=99)  # warm-up: first-call costs
        if fit_threads is not None:
            job = mappers.StartFit(pb.StartFitRequest(
                sender_model=S, receiver_model=L, budget_tokens=20_000_000,
                source=pb.CalibrationSource(corpus=pb.CalibrationCorpus(name="random", seed=1)),
            ), metadata=admin_md)
            job_id = job.job_id
            deadline = time.monotonic() + 120
            while True:  # measure only once the child computes (its start-up is not fitting)
                got = mappers.GetJob(pb.GetJobRequest(job_id=job_id), metadata=admin_md)
                if got.rows_done > 0:
                    break
                if time.monotonic() > deadline or got.phase not in (pb.FIT_JOB_PHASE_QUEUED,
                                                                    pb.FIT_JOB_PHASE_RUNNING):
                    raise SystemExit(f"the fitting job did not start fitting: {got}")
                time.sleep(0.1)
            rows0, t0 = got.rows_done, time.monotonic()
        measured = _turns(stubs, channel, turns, prompt_tokens, new_tokens, seed=1)
        if job_id is not None:
            got = mappers.GetJob(pb.GetJobRequest(job_id=job_id), metadata=admin_md)
            if got.phase != pb.FIT_JOB_PHASE_RUNNING:
                raise SystemExit(f"the fitting job ended during the turns: {got}")
            rate = (got.rows_done - rows0) / (time.monotonic() - t0)
            mappers.CancelJob(pb.CancelJobRequest(job_id=job_id), metadata=admin_md)
    finally:
        channel.close()
        server.stop(grace_s=None)
        service.close()
    wall_ms = [1e3 * v for v in measured["wall_s"]]
    ttft_ms = [1e3 * v for v in measured["ttft_s"]]
    return {
        "fit_threads": fit_threads,
        "turn_p50_ms": statistics.median(wall_ms),
        "turn_p95_ms": _pct(wall_ms, 0.95),
        "ttft_p50_ms": statistics.median(ttft_ms),
        "ttft_p95_ms": _pct(ttft_ms, 0.95),
        "fit_tokens_per_s": rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=12, help="turns per condition")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=8)
    cores = os.cpu_count() or 1
    parser.add_argument("--serve-threads", type=int, default=max(1, cores - 1),
                        help="the serving process's torch threads (default: the cores the cap leaves)")
    add_json_flag(parser)
    args = parser.parse_args()
    logs_to_stderr()
    enter_numerics("auto", "benchmarks.bench_fit_job", None)
    if cores < 2:
        raise SystemExit("this benchmark compares a capped job with an uncapped one: it needs 2+ cores")
    conditions = {"no job": None, "job, fit_threads=1": 1, f"job, fit_threads={cores}": cores}
    rows = {}
    for name, threads in conditions.items():
        with tempfile.TemporaryDirectory(prefix="bench_fit_job_") as tmp:
            rows[name] = _condition(Path(tmp), fit_threads=threads, serve_threads=args.serve_threads,
                                    turns=args.turns, prompt_tokens=args.prompt_tokens,
                                    new_tokens=args.new_tokens)
    base = rows["no job"]
    for row in rows.values():
        row["turn_p50_vs_no_job"] = row["turn_p50_ms"] / base["turn_p50_ms"]
        row["ttft_p50_vs_no_job"] = row["ttft_p50_ms"] / base["ttft_p50_ms"]
    out = table_stream(args.json)
    print(f"turns on {S} (cold prefill of {args.prompt_tokens} tokens + {args.new_tokens} generated, "
          f"{args.turns} per condition, serving with {args.serve_threads} torch threads) while a fitting "
          f"job runs; {cpu_model()}, {cores} cores", file=out)
    print(f"{'condition':<22s}{'turn p50':>10s}{'p95':>9s}{'TTFT p50':>10s}{'p95':>9s}{'x no job':>10s}"
          f"{'fit tok/s':>11s}", file=out)
    for name, r in rows.items():
        rate = f"{r['fit_tokens_per_s']:.0f}" if r["fit_tokens_per_s"] is not None else "-"
        print(f"{name:<22s}{r['turn_p50_ms']:>9.0f} {r['turn_p95_ms']:>8.0f} {r['ttft_p50_ms']:>9.0f} "
              f"{r['ttft_p95_ms']:>8.0f} {r['turn_p50_vs_no_job']:>9.2f}x{rate:>11s}", file=out)
    doc = {
        "benchmark": "bench_fit_job",
        "hardware": {"cpu": cpu_model(), "cores": cores, "machine": platform.machine()},
        "numerics": numerics_record(),
        "turns": args.turns, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "serve_threads": args.serve_threads,
        "conditions": rows,
        "capped_turn_p50_vs_no_job": rows["job, fit_threads=1"]["turn_p50_vs_no_job"],
        "uncapped_turn_p50_vs_no_job": rows[f"job, fit_threads={cores}"]["turn_p50_vs_no_job"],
    }
    write_json(doc, args.json)


if __name__ == "__main__":
    main()
