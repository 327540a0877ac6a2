"""Policies changed in SQL while the node was down (or by another replica) reach the store at start-up.

Narration (node region "eu-1", model "a": seeded random-init v41-tiny, chunks of 32 tokens): acme and
globex each run a 70-token turn, chunks stored -> the node stops -> in SQL, acme's residency becomes
us-east only and globex's ceiling 1 ms -> the node restarts: the store holds acme's new policy and none
of its chunks (residency purge), globex's chunks are past their ceiling; the registry rows naming them
are dropped by the reconciliation; both next turns are cold prefills, acme's not persisted -> a third
start with nothing changed writes no policy record.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from sqlalchemy import select
from sqlalchemy.orm import Session
from structlog.testing import capture_logs

from orchestrator.db import PolicyRepository, TenantRepository, make_engine
from orchestrator.db.models import CacheSegment, Policy
from storage import AuditAction, MissReason, RetentionPolicy
from tests.orchestrator.engine.node_harness import admin_md, md, registry, run_turn, start_node


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def _segments(node, tenant: str) -> int:
    with node.service.ctx.sessions() as s:
        return len(list(s.scalars(select(CacheSegment).where(CacheSegment.tenant_id == tenant))))


def _policy_records(node) -> list[tuple[str, str]]:
    records = node.service.store.audit.iter_records()
    return [(r.tenant, r.actor) for r in records if r.action == AuditAction.POLICY_CHANGE]


def test_build_node_syncs_policies_changed_while_down(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    models = registry()
    first = start_node(tmp_path, models)
    sids: dict[str, str] = {}
    histories: dict[str, list[int]] = {}
    try:
        pb = first.pb
        for seed, tenant in ((1, "acme"), (2, "globex")):
            sids[tenant] = first.sessions.CreateSession(
                pb.sessions.CreateSessionRequest(model="a"), metadata=md(tenant)
            ).session.session_id
            prompt = _ids(seed, 70)
            t = run_turn(first, sids[tenant], prompt, tenant=tenant, max_new=1)
            assert t.path == "COLD_PREFILL" and t.stats.persisted
            histories[tenant] = prompt + t.tokens
            assert first.service.store.tenant_stats(tenant).chunks >= 2
        fp = models.get("a").fingerprint_hex
    finally:
        first.stop()

    # Another replica (or an admin tool against SQL) changes both policies while this node is down.
    engine = make_engine(f"sqlite:///{tmp_path / 'registry.sqlite3'}")
    with Session(engine) as s, s.begin():
        PolicyRepository(s).set("acme", floor_s=0.0, ceiling_s=86400.0, allowed_regions=["us-east"])
        PolicyRepository(s).set("globex", floor_s=0.0, ceiling_s=0.001, allowed_regions=[])
    engine.dispose()

    second = start_node(tmp_path, models)
    try:
        store = second.service.store
        assert store.get_policy("acme") == RetentionPolicy(
            floor_s=0.0, ceiling_s=86400.0, allowed_regions=("us-east",)
        )
        assert store.get_policy("globex") == RetentionPolicy(floor_s=0.0, ceiling_s=0.001)
        assert store.tenant_stats("acme").chunks == 0
        assert store.lookup("globex", fp, histories["globex"]).miss.reason == MissReason.EXPIRED
        assert _segments(second, "acme") == _segments(second, "globex") == 0
        # acme's rows went with the store's per-chunk purge records (mirrored with their rows dropped),
        # globex's, past their ceiling, in the reconciliation.
        assert second.service.reconcile.dangling_rows_deleted >= 2
        assert sorted(_policy_records(second)) == [("acme", "node_start"), ("globex", "node_start")]

        t = run_turn(second, sids["acme"], _ids(3, 8), tenant="acme", max_new=1)
        assert t.path == "COLD_PREFILL" and not t.stats.persisted
        t = run_turn(second, sids["globex"], _ids(4, 8), tenant="globex", max_new=1)
        assert t.path == "COLD_PREFILL", t.plan.reason
        seen = len(_policy_records(second))
    finally:
        second.stop()

    third = start_node(tmp_path, models)
    try:
        assert len(_policy_records(third)) == seen
    finally:
        third.stop()


def test_a_policy_row_the_store_refuses_does_not_stop_a_restart(tmp_path: Path) -> None:
    # An older version stored ceiling_s=inf (it validated only > 0); every start-up sync then exited 1.
    torch.set_num_threads(1)
    models = registry()
    first = start_node(tmp_path, models)
    first.stop()
    engine = make_engine(f"sqlite:///{tmp_path / 'registry.sqlite3'}")
    with Session(engine) as s, s.begin():
        TenantRepository(s).ensure("acme")
        s.add(Policy(tenant_id="acme", retention_floor_s=1.0, retention_ceiling_s=float("inf"),
                     allowed_regions=[]))
    engine.dispose()
    with capture_logs() as logs:
        second = start_node(tmp_path, models)
    try:
        refused = [e for e in logs if e["event"] == "policy_sync_refused"]
        assert [e["tenant"] for e in refused] == ["acme"] and "ceiling_s" in refused[0]["error"]
        # the node serves, and an admin can replace the bad row with a valid one
        pb = second.pb
        got = second.admin.SetRetentionPolicy(
            pb.admin.RetentionPolicy(tenant_id="acme", floor_s=1.0, ceiling_s=3600.0), metadata=admin_md()
        )
        assert got.ceiling_s == 3600.0
        assert second.service.store.get_policy("acme") == RetentionPolicy(floor_s=1.0, ceiling_s=3600.0)
    finally:
        second.stop()
