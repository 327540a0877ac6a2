"""Caches across numerics profiles: a node serving another CPU path does not hit chunks another profile
wrote (the plan says which profile they were computed under), and the writer's profile still hits them."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from orchestrator.db import SegmentRepository
from orchestrator.engine import ModelRegistry, ServedModelSpec
from orchestrator.numerics_env import resolve_cpu_path
from tests.orchestrator.engine.node_harness import md, run_turn, start_node

# the pinned path the suite runs under (tests/conftest.py): portable, or strict where portable's GEMM probe
# fails
_PINNED = resolve_cpu_path("auto")
_PORTABLE = f"numerics.v1 device=cpu dtype=bf16 kernels=torch cpu={_PINNED} math=exact batching=invariant"
# a native node's label names what it computes on (torch capability; CPU model; dispatch variables)
_NATIVE = "numerics.v1 device=cpu dtype=bf16 kernels=torch cpu=native[AVX2;"


def _registry(cpu_path: str) -> ModelRegistry:
    return ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)}, cpu_path=cpu_path)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def test_chunks_of_another_profile_are_a_miss_naming_it(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    writer = start_node(tmp_path, _registry(_PINNED))
    try:
        sid = writer.sessions.CreateSession(
            writer.pb.sessions.CreateSessionRequest(model="a"), metadata=md()
        ).session.session_id
        t0 = run_turn(writer, sid, _ids(1, 70))
        assert t0.path == "COLD_PREFILL" and t0.stats.persisted
        with writer.service.ctx.sessions() as s:
            assert {seg.numerics for seg in SegmentRepository(s).for_session(sid)} == {_PORTABLE}
        written = 70 + len(t0.tokens)
    finally:
        writer.stop()

    # Same weights, same data dir, another CPU path: every stored chunk is a miss, and the plan names why.
    reader = start_node(tmp_path, _registry("native"))
    try:
        t1 = run_turn(reader, sid, _ids(2, 5))
        assert t1.path == "COLD_PREFILL"
        assert f"computed under numerics profile {_PORTABLE}" in t1.plan.reason
        assert f"this node computes under {_NATIVE}" in t1.plan.reason
        assert t1.stats.counts.cached == 0 and t1.stats.counts.prefilled == written + 5
    finally:
        reader.stop()

    # The writer's profile still reads its own chunks: the miss above came from the profile alone.
    again = start_node(tmp_path, _registry(_PINNED))
    try:
        t2 = run_turn(again, sid, _ids(3, 4))
        assert t2.path == "GLOBAL_REPLAY" and t2.stats.counts.cached > 0
    finally:
        again.stop()
