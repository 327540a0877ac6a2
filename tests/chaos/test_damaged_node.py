"""A real node (SQLite registry, RocksDB store, loopback gRPC) restarted on a damaged store: it starts,
serves cold, reports `kvresume.store` NOT_SERVING while "" stays SERVING, reconciles the registry rows
of the quarantined chunks away, and is healthy again after `kvresume admin store repair`."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from storage import StoreConfig, check_store, repair_store
from tests.chaos.node_health import STORE, degraded_gauge, health_status
from tests.chaos.store_damage import DAMAGES
from tests.orchestrator.engine.node_harness import md, registry, run_turn, start_node


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def test_node_on_a_damaged_store_starts_degraded_and_serves_cold(tmp_path: Path, chaos_report) -> None:
    torch.set_num_threads(1)
    t0 = time.monotonic()
    key = tmp_path / "anchor.key"
    key.write_bytes(b"chaos-anchor-key-" * 3)
    first = start_node(tmp_path, registry(), audit_anchor_key_file=key)
    try:
        assert health_status(first.channel, STORE) == "SERVING"
        sid = first.sessions.CreateSession(
            first.pb.sessions.CreateSessionRequest(model="a"), metadata=md()
        ).session.session_id
        assert run_turn(first, sid, _ids(1, 70)).path == "COLD_PREFILL"
        assert first.service.store.stats().chunks > 0
    finally:
        first.stop()

    what = DAMAGES["sst_bitflips"](tmp_path / "kv" / "db", random.Random(5))
    second = start_node(tmp_path, registry(), audit_anchor_key_file=key)
    try:
        store = second.service.store
        assert store.quarantined_at_open is not None and store.stats().chunks == 0
        assert second.service.reconcile.dangling_rows_deleted > 0
        assert health_status(second.channel, "") == "SERVING"
        assert health_status(second.channel, STORE) == "NOT_SERVING"
        gauge = degraded_gauge(second.service.ctx.metrics.exposition())
        assert gauge == {"quarantined": 1.0, "read_error": 0.0, "write_failing": 0.0}
        # The session continues: its history is recomputed (nothing of the damaged store is served).
        turn = run_turn(second, sid, _ids(2, 5))
        assert turn.path == "COLD_PREFILL"
        records = [r.action.value for r in store.audit.iter_records()]
        assert records[0] == "quarantine"
        # The store's chain starts again; audit verify (both chains, their agreement, the anchors of
        # the replaced store's chain) still holds.
        report = second.service.ctx.audit_checker.verify()
        assert report.verdict == "ok", report.problems
    finally:
        second.stop()

    cfg = StoreConfig(path=str(tmp_path / "kv"), chunk_tokens=32, compression_ratios=(1, 2))
    repaired = repair_store(cfg, actor="admin:chaos")
    assert repaired.quarantined is None and len(repaired.removed) == 1
    assert check_store(cfg).healthy and check_store(cfg).quarantined == []
    third = start_node(tmp_path, registry(), audit_anchor_key_file=key)
    try:
        assert health_status(third.channel, STORE) == "SERVING"
        assert run_turn(third, sid, _ids(3, 5)).path in ("GLOBAL_REPLAY", "FULL_HIT")
        report = third.service.ctx.audit_checker.verify()
        assert report.verdict == "ok", report.problems
    finally:
        third.stop()
    chaos_report.record(
        "damaged_node",
        damage=what,
        started_degraded=True,
        dangling_rows_deleted=second.service.reconcile.dangling_rows_deleted,
        wall_s=round(time.monotonic() - t0, 2),
    )
