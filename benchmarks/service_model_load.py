"""A real-model load run of the service: many concurrent agent sessions on one served model over loopback
gRPC, with the batching scheduler or the serial baseline.

Each session: a first turn of `first_tokens` new tokens, then turns of 16-32 new tokens, 4 generated
tokens per turn. Reported: client-side turn latency p50/p99 (request to the stats event), turns/s over
the run's wall time, the engine's TTFT p99 (stats.ttft_s), the mean scheduler queue wait per forward
pass, and aggregate decode tokens/s (generated tokens over wall time); for the batching scheduler also
its steps, the mean decode batch, the CPU time of the threads that ran the steps per turn (in-process:
the model's arithmetic and Python; with a model process only this side's) and the steps' wall time over
that CPU time (above 1: the steps waited for the GIL the service's threads hold, or for a core); and the
CPU per turn of this process (the service with the in-process clients) and of the model process, in all
and by operation (its own accounting), which say which of the two bounds the run.

The service is built and its garbage collector tuned as `kvresume serve` does (`tune_gc` setting,
orchestrator/heap.py; released at the run's end, since one process runs several services).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.concurrency import run_clients
from orchestrator.api import build_server
from orchestrator.cpu_split import CpuSplit, enter_cpu_split
from orchestrator.engine import ModelRegistry, ServedModelSpec, build_node
from orchestrator.heap import tune_gc_for_serving
from orchestrator.settings import Settings

__all__ = ["ASYNC_POOL_WORKERS", "DEFAULT_MODEL_PROCESS_CPUS", "model_load"]

_TENANTS = ("bench-a", "bench-b", "bench-c", "bench-d")
# The asyncio server's pool in every benchmark run, whatever the concurrency: its turns hold no thread
# while they wait for passes (measured: 2, 8 and 64 workers gave the same turns/s at 64 no-op sessions).
ASYNC_POOL_WORKERS = 8
# the CPU split `kvresume serve` applies when its settings say nothing (orchestrator/cpu_split.py)
DEFAULT_MODEL_PROCESS_CPUS = Settings.__dataclass_fields__["model_process_cpus"].default


def _registry(checkpoint: Path) -> ModelRegistry:
    return ModelRegistry({"m": ServedModelSpec(name="m", checkpoint=checkpoint)})


def _sum_count(histogram: Any) -> tuple[float, int]:
    """A histogram's sum and count over all its label values."""
    total = count = 0.0
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_count"):
                count += s.value
    return total, int(count)


def model_load(
    root: Path,
    checkpoint: Path,
    *,
    scheduler: str,
    sessions: int,
    turns: int,
    first_tokens: int = 64,
    generated: int = 4,
    model_process: str = "inline",
    grpc_server: str = "threads",
    model_process_cpus: str = DEFAULT_MODEL_PROCESS_CPUS,
) -> dict[str, Any]:
    """One load run; raises RuntimeError when any turn fails.

    `model_process_cpus` is applied as `kvresume serve` applies it (`cpu_split.enter_cpu_split`): with
    a model process, this process is pinned to the service's CPUs for the run and unpinned after it.
    """
    settings = Settings(
        data_dir=root,
        tenant_tokens={t: f"tok-{t}" for t in _TENANTS},
        admin_token="bench-admin",
        grpc_port=0,
        metrics_enabled=False,
        kv_chunk_tokens=256,
        pool_budget_bytes=2 << 30,
        # the thread-pool server holds a thread per stream; the asyncio server none while a turn waits
        grpc_workers=max(16, 2 * sessions) if grpc_server == "threads" else ASYNC_POOL_WORKERS,
        max_sessions_per_tenant=100000,
        max_running_turns=max(96, sessions),
        scheduler=scheduler,
        model_process=model_process,
        grpc_server=grpc_server,
        model_process_cpus=model_process_cpus,
    )
    registry = _registry(checkpoint)
    split, unpin = enter_cpu_split(
        model_process_cpus,
        model_process=model_process,
        model_threads=torch.get_num_threads(),
        device=settings.model_device,
    )
    try:
        return _run(settings, registry, split, sessions=sessions, turns=turns, first_tokens=first_tokens,
                    generated=generated)  # fmt: skip
    finally:
        unpin()


def _run(
    settings: Settings,
    registry: ModelRegistry,
    split: CpuSplit | None,
    *,
    sessions: int,
    turns: int,
    first_tokens: int,
    generated: int,
) -> dict[str, Any]:
    scheduler, model_process, grpc_server = settings.scheduler, settings.model_process, settings.grpc_server
    node = build_node(settings, registry=registry, preload=True, model_cpus=split.model if split else ())
    server = build_server(node.ctx, host="127.0.0.1", port=0)
    # the collector tuned as `kvresume serve` tunes it once it serves (orchestrator/heap.py); released when
    # the run ends, since this process runs several services one after another
    tuned = tune_gc_for_serving() if settings.tune_gc else None
    pb = node.ctx.stubs
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb.sessions_grpc.SessionsStub(channel)
    vocab = registry.get("m").vocab_size  # type: ignore[union-attr]
    latencies: list[float] = []
    ttfts: list[float] = []
    generated_total = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def session(i: int) -> None:
        rng = random.Random(i)
        tenant = _TENANTS[i % len(_TENANTS)]
        md = (("authorization", f"Bearer tok-{tenant}"),)
        try:
            created = stub.CreateSession(pb.sessions.CreateSessionRequest(model="m"), metadata=md)
            sid = created.session.session_id
            for t in range(turns):
                n = first_tokens if t == 0 else rng.randrange(16, 33)
                req = pb.sessions.TurnRequest(
                    session_id=sid,
                    tokens=pb.sessions.TokenIds(ids=[rng.randrange(16, vocab) for _ in range(n)]),
                    generation=pb.sessions.GenerationParams(max_new_tokens=generated),
                )
                t0 = time.perf_counter()
                stats = None
                for ev in stub.Turn(req, metadata=md):
                    if ev.WhichOneof("event") == "stats":
                        stats = ev.stats
                elapsed = time.perf_counter() - t0
                assert stats is not None
                with lock:
                    latencies.append(elapsed)
                    ttfts.append(stats.ttft_s)
                    generated_total[0] += stats.generated_tokens
        except grpc.RpcError as exc:
            with lock:
                errors.append(f"{exc.code().name}: {exc.details()}")

    # With a model process, its own accounting before and after the run (the model's CPU is there)
    model_stats = getattr(node.engine.compute, "stats", None)
    model0 = model_stats() if model_stats is not None else None
    cpu0 = time.process_time()
    wall = run_clients(session, sessions)
    service_cpu = time.process_time() - cpu0
    model1 = model_stats() if model_stats is not None else None
    metrics = node.ctx.metrics
    wait_sum, wait_count = _sum_count(metrics.queue_wait)
    step_wall, steps = _sum_count(metrics.step_seconds)
    step_cpu, _ = _sum_count(metrics.step_cpu_seconds)
    decoded, decode_steps = _sum_count(metrics.batch_sequences)
    channel.close()
    server.stop(grace_s=None)
    node.close()
    if tuned is not None:
        tuned.release()
    if errors:
        raise RuntimeError(f"{len(errors)} sessions failed ({scheduler}, {sessions}): {errors[:3]}")
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    tq = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
    return {
        "scheduler": scheduler,
        "model_process": model_process,
        "model_process_cpus": sorted(split.model) if split else None,
        "service_cpus": sorted(split.service) if split else None,
        "grpc_server": grpc_server,
        "grpc_workers": settings.grpc_workers,
        "sessions": sessions,
        "turns": len(latencies),
        "wall_s": wall,
        "turns_per_s": len(latencies) / wall,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": q[98] * 1e3,
        "engine_ttft_p99_ms": tq[98] * 1e3,
        "queue_wait_mean_ms": (wait_sum / wait_count * 1e3) if wait_count else 0.0,
        "decode_tokens_per_s": generated_total[0] / wall,
        "steps": steps,
        "decodes_per_step": decoded / decode_steps if decode_steps else None,
        "step_cpu_ms_per_turn": step_cpu / len(latencies) * 1e3 if steps else None,
        "step_wall_over_cpu": step_wall / step_cpu if step_cpu else None,
        # this process (the service and the benchmark's in-process clients), and the model process
        "service_cpu_ms_per_turn": service_cpu / len(latencies) * 1e3,
        # start-up objects out of the collector's reach (orchestrator/heap.py): this process's, the model
        # process's (None: not tuned, or no model process)
        "frozen_objects": tuned.objects if tuned is not None else None,
        "model_process_frozen_objects": model0.get("frozen_objects") if model0 is not None else None,
        **_model_process_cpu(model0, model1, len(latencies), wall),
    }


def _model_process_cpu(before: dict | None, after: dict | None, turns: int, wall_s: float) -> dict[str, Any]:
    """The model process's CPU per turn over the run, in all and by operation (`ProcessCompute.stats`),
    and its CPU over the run's wall (`model_process_busy`: with the model process on one CPU of its own,
    the share of the run it computed; the batched arm's turns/s is its CPU a turn's inverse times this);
    None without a model process."""
    if before is None or after is None:
        return {"model_process_cpu_ms_per_turn": None, "model_ops_cpu_ms_per_turn": None,
                "model_process_busy": None}  # fmt: skip
    ops = {
        op: (cpu - before["ops"].get(op, (0, 0.0, 0.0))[1]) / turns * 1e3
        for op, (_, cpu, _) in after["ops"].items()
    }
    cpu_s = after["process_cpu_s"] - before["process_cpu_s"]
    return {
        "model_process_cpu_ms_per_turn": cpu_s / turns * 1e3,
        "model_process_busy": cpu_s / wall_s if wall_s else None,
        "model_ops_cpu_ms_per_turn": {op: ms for op, ms in sorted(ops.items(), key=lambda kv: -kv[1]) if ms},
    }
