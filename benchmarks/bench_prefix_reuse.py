"""Content-addressed prefix reuse: the pool's prefix index against its slow twin, and a stateless agent
session over real gRPC with the trained v41-sib-s, with reuse against the same requests served cold.

Part 1 (no model): `WindowPool.find_prefix` (one sha256 pass over the prompt, a digest per indexed
length) against `longest_prefix_by_scan` (id-by-id comparison with every pooled history), on N pooled
histories that share a system prompt; both must return the same length on every query.
Part 2 (model): R requests, each a fresh session carrying the whole conversation (the previous request,
its answer and a new tool result), sent by tenant `reuse`; the same requests each sent by a tenant of its
own (nothing stored for it: a cold prefill of the whole prompt, the stateless endpoint's baseline), in
the same process. TTFT is the engine's (stats.ttft_s). Refuses to report unless every reuse request after
the first is a FULL_HIT whose tokens equal one session continued turn by turn (tenant `session`).

Run: python -m benchmarks.bench_prefix_reuse [--histories 1000] [--requests 8] [--json PATH|-]
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

import grpc
import torch

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from orchestrator.api import build_server
from orchestrator.engine import ModelRegistry, ServedModelSpec, build_node, repo_root
from orchestrator.settings import Settings
from storage import ContentKey, PoolConfig, WindowPool, longest_prefix_by_scan

MODEL = "v41-sib-s"


def bench_index(n_histories: int, system_tokens: int, queries: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    system = [rng.randrange(16, 4096) for _ in range(system_tokens)]
    pool = WindowPool(PoolConfig(budget_bytes=1 << 30, ttl_s=3600.0))
    histories: dict[str, list[int]] = {}
    for i in range(n_histories):
        history = system + [rng.randrange(16, 4096) for _ in range(rng.randrange(1, 2000))]
        histories[f"s{i}"] = history
        pool.put("t", f"s{i}", b"w", content=ContentKey.of("fp", history))
    fast, slow = [], []
    for _ in range(queries):
        base = histories[rng.choice(list(histories))]
        prompt = base + [rng.randrange(16, 4096) for _ in range(50)]
        t0 = time.perf_counter()
        got = pool.find_prefix("t", "fp", prompt, max_tokens=len(prompt) - 1)
        fast.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        n, _ = longest_prefix_by_scan(histories.items(), prompt, len(prompt) - 1)
        slow.append(time.perf_counter() - t0)
        if got is None or got.n_tokens != n:
            raise SystemExit(f"index and scan disagree: {got} vs {n}")
    fast_ms, slow_ms = 1e3 * statistics.median(fast), 1e3 * statistics.median(slow)
    return {
        "histories": n_histories,
        "system_tokens": system_tokens,
        "prompt_tokens_mean": statistics.mean(len(h) for h in histories.values()) + 50,
        "find_prefix_p50_ms": fast_ms,
        "scan_p50_ms": slow_ms,
        "speedup_vs_scan": slow_ms / fast_ms,
    }


def _turn(stubs, channel, token: str, sid: str, ids: list[int], max_new: int):
    stub = stubs.sessions_grpc.SessionsStub(channel)
    request = stubs.sessions.TurnRequest(
        session_id=sid,
        tokens=stubs.sessions.TokenIds(ids=ids),
        generation=stubs.sessions.GenerationParams(max_new_tokens=max_new),
    )
    plan = stats = None
    out: list[int] = []
    for event in stub.Turn(request, metadata=(("authorization", f"Bearer {token}"),)):
        kind = event.WhichOneof("event")
        if kind == "plan":
            plan = event.plan
        elif kind == "tokens":
            out += list(event.tokens.ids)
        else:
            stats = event.stats
    assert plan is not None and stats is not None
    return stubs.common.ResumePath.Name(plan.path).removeprefix("RESUME_PATH_"), stats, out


def _create(stubs, channel, token: str) -> str:
    stub = stubs.sessions_grpc.SessionsStub(channel)
    got = stub.CreateSession(
        stubs.sessions.CreateSessionRequest(model=MODEL), metadata=(("authorization", f"Bearer {token}"),)
    )
    return got.session.session_id


def bench_agent(requests: int, data_dir: Path, seed: int = 1) -> dict[str, object]:
    ckpt = repo_root() / "checkpoints" / MODEL
    registry = ModelRegistry({MODEL: ServedModelSpec(name=MODEL, checkpoint=ckpt)})
    tokens = {"reuse": "tok-reuse", "session": "tok-session"}
    tokens |= {f"cold{i}": f"tok-cold{i}" for i in range(requests)}
    settings = Settings(
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir / 'registry.sqlite3'}",
        tenant_tokens=tokens,
        admin_token="tok-admin",
        grpc_port=0,
        metrics_enabled=False,
        region="eu-1",
        kv_chunk_tokens=32,
    )
    service = build_node(settings, registry=registry)
    server = build_server(service.ctx, host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stubs = service.ctx.stubs
    rng = random.Random(seed)
    parts = [[rng.randrange(16, 4096) for _ in range(600)]]
    parts += [[rng.randrange(16, 4096) for _ in range(rng.randrange(30, 90))] for _ in range(requests - 1)]
    rows = []
    try:
        conversation: list[int] = []
        one = _create(stubs, channel, tokens["session"])
        for k, part in enumerate(parts):
            prompt = conversation + part
            path, stats, out = _turn(
                stubs, channel, tokens["reuse"], _create(stubs, channel, tokens["reuse"]), prompt, 4
            )
            cold_path, cold_stats, _ = _turn(
                stubs, channel, tokens[f"cold{k}"], _create(stubs, channel, tokens[f"cold{k}"]), prompt, 4
            )
            ref_path, ref_stats, ref_out = _turn(stubs, channel, tokens["session"], one, part, 4)
            if k and (path != "FULL_HIT" or out != ref_out):
                raise SystemExit(f"request {k}: {path}, tokens {out} vs the continued session's {ref_out}")
            assert cold_path == "COLD_PREFILL", cold_path
            rows.append(
                {
                    "request": k,
                    "prompt_tokens": len(prompt),
                    "path": path,
                    "cached": int(stats.counts.cached),
                    "ttft_ms": 1e3 * stats.ttft_s,
                    "cold_ttft_ms": 1e3 * cold_stats.ttft_s,
                    "session_ttft_ms": 1e3 * ref_stats.ttft_s,
                    "session_path": ref_path,
                }
            )
            conversation = prompt + out
    finally:
        channel.close()
        server.stop(grace_s=None)
        service.close()
    later = rows[1:]
    return {
        "model": MODEL,
        "requests": rows,
        "full_hit_share": sum(r["path"] == "FULL_HIT" for r in later) / max(1, len(later)),
        "cached_share": sum(r["cached"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
        "ttft_ratio_vs_cold_p50": statistics.median(r["ttft_ms"] / r["cold_ttft_ms"] for r in later),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=int, default=1000)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--requests", type=int, default=8, help="requests of the agent session (0: skip)")
    add_json_flag(parser)
    args = parser.parse_args()
    logs_to_stderr()
    # the served default; the real model refuses a profile that is not in force
    enter_numerics("auto", "benchmarks.bench_prefix_reuse", None)
    torch.set_num_threads(1)
    index = bench_index(args.histories, args.system_tokens, args.queries)
    agent = None
    if args.requests > 0:
        with tempfile.TemporaryDirectory(prefix="bench_prefix_reuse_") as tmp:
            agent = bench_agent(args.requests, Path(tmp))
    out = table_stream(args.json)
    print(
        f"prefix index, {index['histories']} pooled histories sharing {index['system_tokens']} tokens "
        f"(prompts ~{index['prompt_tokens_mean']:.0f} tokens):",
        file=out,
    )
    print(
        f"  find_prefix {index['find_prefix_p50_ms']:.3f} ms p50, "
        f"linear scan {index['scan_p50_ms']:.3f} ms p50, speedup {index['speedup_vs_scan']:.1f}x",
        file=out,
    )
    if agent is not None:
        print(f"stateless agent session, {MODEL}, engine TTFT (ms):", file=out)
        print(
            f"{'req':>4s}{'prompt':>8s}{'path':>14s}{'cached':>8s}{'reuse':>9s}{'cold':>9s}{'session':>9s}",
            file=out,
        )
        for r in agent["requests"]:  # type: ignore[union-attr]
            print(
                f"{r['request']:4d}{r['prompt_tokens']:8d}{r['path']:>14s}{r['cached']:8d}"
                f"{r['ttft_ms']:9.1f}{r['cold_ttft_ms']:9.1f}{r['session_ttft_ms']:9.1f}",
                file=out,
            )
        print(
            f"full-hit share {agent['full_hit_share']:.2f}, cached share {agent['cached_share']:.3f}, "
            f"TTFT reuse/cold p50 {agent['ttft_ratio_vs_cold_p50']:.3f}",
            file=out,
        )
    write_json(
        {
            "numerics": numerics_record(),
            "index": index,
            "agent": agent,
            "threads": 1,
            "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        },
        args.json,
    )


if __name__ == "__main__":
    main()
