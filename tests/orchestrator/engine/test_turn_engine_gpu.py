"""The turn engine with models on CUDA: a cold prefill, then a full hit whose counts equal its plan's, and
caches fingerprinted for the CUDA numerics profile (a CPU node's chunks would be misses)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from orchestrator.engine import ModelRegistry, ServedModelSpec
from tests.orchestrator.engine.node_harness import counts, md, run_turn, start_node


@pytest.mark.gpu
def test_turn_engine_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    models = ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)}, device="cuda")
    cpu = ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)})
    assert models.get("a").fingerprint != cpu.get("a").fingerprint
    node = start_node(tmp_path, models)
    try:
        pb = node.pb
        sid = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md()).session
        rng = random.Random(0)
        first = run_turn(node, sid.session_id, [rng.randrange(16, 512) for _ in range(100)])
        assert first.path == "COLD_PREFILL" and first.stats.persisted
        second = run_turn(node, sid.session_id, [rng.randrange(16, 512) for _ in range(10)])
        assert second.path == "FULL_HIT"
        assert counts(second.stats.counts) == counts(second.plan.counts)
        assert second.stats.counts.cached == 103
    finally:
        node.stop()
