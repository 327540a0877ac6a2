"""Seeded damage to the RocksDB directory a real node wrote (its turns over loopback gRPC, SQLite
registry), one node restart per damage: every restart succeeds, every session continues, and a session
whose store was quarantined gets exactly the tokens of a cold computation of its whole history (nothing
of the damaged store reached it). Slow: one node start per damage."""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from tests.chaos.node_health import STORE, health_status
from tests.chaos.store_damage import DAMAGES
from tests.orchestrator.engine.node_harness import (
    admin_md,
    md,
    registry,
    run_turn,
    start_node,
    uninterrupted_greedy,
)

KINDS = (
    "sst_bitflips",
    "sst_truncate",
    "manifest_truncate",
    "current_delete",
    "clock_mark_2_bytes",
    "audit_head_1_byte",
    "policy_invalid_json",
    "format_mark_garbage",
    "chunk_value_edits",
    "meta_edits",
)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


@pytest.mark.slow
def test_node_restarts_on_each_damaged_store(tmp_path: Path, chaos_report) -> None:
    torch.set_num_threads(1)
    t0 = time.monotonic()
    models = registry()
    base = tmp_path / "base"
    node = start_node(base, models)
    histories: dict[str, list[int]] = {}
    try:
        node.admin.SetRetentionPolicy(
            node.pb.admin.RetentionPolicy(tenant_id="acme", floor_s=3600.0, ceiling_s=86400.0),
            metadata=admin_md(),
        )
        for s in range(3):
            sid = node.sessions.CreateSession(
                node.pb.sessions.CreateSessionRequest(model="a"), metadata=md()
            ).session.session_id
            prompt = _ids(100 + s, 70 + 20 * s)
            turn = run_turn(node, sid, prompt)
            histories[sid] = prompt + turn.tokens
    finally:
        node.stop()

    results = []
    for k, kind in enumerate(KINDS):
        root = tmp_path / kind
        shutil.copytree(base, root)
        what = DAMAGES[kind](root / "kv" / "db", random.Random(k))
        node = start_node(root, models)
        try:
            store = node.service.store
            quarantined = store.quarantined_at_open is not None
            status = health_status(node.channel, STORE), health_status(node.channel, "")
            exact = paths = 0
            for n, (sid, history) in enumerate(histories.items()):
                new = _ids(200 + n, 6)
                turn = run_turn(node, sid, new)
                paths += 1
                if quarantined:
                    assert turn.path == "COLD_PREFILL"
                    want = uninterrupted_greedy(models, "a", history + new, len(turn.tokens))
                    assert turn.tokens == want, (kind, sid)
                    exact += 1
            results.append(
                {
                    "damage": kind,
                    "what": what,
                    "quarantined": quarantined,
                    "store_health": status[0],
                    "overall_health": status[1],
                    "turns": paths,
                    "turns_checked_against_cold": exact,
                    "rows_reconciled_away": node.service.reconcile.dangling_rows_deleted,
                }
            )
            assert status[1] == "SERVING"
            assert status[0] == ("NOT_SERVING" if quarantined else "SERVING")
        finally:
            node.stop()
    chaos_report.record(
        "damaged_node_catalogue",
        damaged_stores=len(results),
        refusals_to_start=0,
        quarantined=sum(r["quarantined"] for r in results),
        turns_after_damage=sum(r["turns"] for r in results),
        turns_equal_to_cold=sum(r["turns_checked_against_cold"] for r in results),
        by_damage=results,
        wall_s=round(time.monotonic() - t0, 2),
    )
