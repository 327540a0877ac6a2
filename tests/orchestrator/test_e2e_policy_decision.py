"""A policy change is one decision of SQL and the store, and no admin input stops a restart (issue 13 item 1).

Real node (SQLite + RocksDB, gRPC over loopback, seeded random-init v41-tiny as model "a"). Narration:
bad retention and residency requests (inf, NaN, negative, a 1 MiB tenant id, 1000 regions, an empty
label) -> INVALID_ARGUMENT naming the field, no policy row, no audit record, the store unchanged -> a
store that fails to apply a valid change (closed) -> UNAVAILABLE, SQL back to the previous policy with a
`store_apply_failed` record -> the node restarts, and audit verify says "ok" with the anchor key set.
"""

from __future__ import annotations

import math
from pathlib import Path

import grpc
import pytest
import torch
from sqlalchemy import select

from orchestrator.db.models import AuditRow, Policy
from storage import RetentionPolicy
from tests.orchestrator.engine.node_harness import admin_md, registry, start_node

BAD_RETENTION = [
    ("acme", 1.0, math.inf, "ceiling_s"),
    ("acme", math.inf, 3600.0, "floor_s"),
    ("acme", math.nan, 3600.0, "floor_s"),
    ("acme", 1.0, math.nan, "ceiling_s"),
    ("acme", -1.0, 3600.0, "floor_s"),
    ("acme", 1.0, -math.inf, "ceiling_s"),
    ("x" * (1 << 20), 1.0, 3600.0, "tenant_id"),
    ("", 1.0, 3600.0, "tenant_id"),
]
BAD_REGIONS = [
    (["eu-1", ""], "allowed_regions"),
    ([f"r{i}" for i in range(1000)], "allowed_regions"),
    (["r" * 4096], "allowed_regions"),
]


def _field(err: grpc.RpcError) -> str:
    from google.rpc import error_details_pb2, status_pb2

    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.metadata.get("field", "")
    return ""


def _scenario(tmp_path: Path, database_url: str | None) -> None:
    torch.set_num_threads(1)
    models = registry()
    key_file = tmp_path / "anchor.key"
    key_file.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    node = start_node(tmp_path, models, database_url=database_url, audit_anchor_key_file=key_file)
    try:
        pb, admin = node.pb, node.admin
        admin.SetRetentionPolicy(
            pb.admin.RetentionPolicy(tenant_id="acme", floor_s=60.0, ceiling_s=7200.0), metadata=admin_md()
        )
        before = node.service.store.get_policy("acme")
        records_before = len(list(node.service.store.audit.iter_records()))
        for tenant, floor, ceiling, field in BAD_RETENTION:
            with pytest.raises(grpc.RpcError) as info:
                admin.SetRetentionPolicy(
                    pb.admin.RetentionPolicy(tenant_id=tenant, floor_s=floor, ceiling_s=ceiling),
                    metadata=admin_md(),
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value.details())
            assert _field(info.value) == field and len(info.value.details()) <= 1024
        for regions, field in BAD_REGIONS:
            with pytest.raises(grpc.RpcError) as info:
                admin.SetResidencyPolicy(
                    pb.admin.ResidencyPolicy(tenant_id="acme", allowed_regions=regions), metadata=admin_md()
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(info.value) == field
        with node.service.ctx.sessions() as s:
            rows = s.scalars(select(Policy)).all()
            assert [(r.tenant_id, r.retention_floor_s, r.retention_ceiling_s) for r in rows] == [
                ("acme", 60.0, 7200.0)
            ]
            assert s.scalars(select(AuditRow).where(AuditRow.tenant != "acme")).all() == []
        assert node.service.store.get_policy("acme") == before
        assert len(list(node.service.store.audit.iter_records())) == records_before

        # The store accepts a valid change but cannot apply it: SQL goes back to what it held.
        store = node.service.store
        real = node.service.ctx.on_policy_change

        def failing(policy, actor):
            raise OSError("No space left on device")

        node.service.ctx.on_policy_change = failing
        try:
            with pytest.raises(grpc.RpcError) as info:
                admin.SetRetentionPolicy(
                    pb.admin.RetentionPolicy(tenant_id="acme", floor_s=1.0, ceiling_s=60.0),
                    metadata=admin_md(),
                )
        finally:
            node.service.ctx.on_policy_change = real
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        got = admin.GetRetentionPolicy(pb.admin.TenantRef(tenant_id="acme"), metadata=admin_md())
        assert (got.floor_s, got.ceiling_s) == (60.0, 7200.0)
        assert store.get_policy("acme") == RetentionPolicy(floor_s=60.0, ceiling_s=7200.0)
        with node.service.ctx.sessions() as s:
            reasons = [r.reason for r in s.scalars(select(AuditRow).where(AuditRow.tenant == "acme"))]
        assert reasons[-1] == "store_apply_failed"
    finally:
        node.stop()

    again = start_node(tmp_path, models, database_url=database_url, audit_anchor_key_file=key_file)
    try:
        report = again.admin.VerifyAudit(again.pb.admin.VerifyAuditRequest(), metadata=admin_md())
        assert report.verdict == "ok" and report.ok, list(report.problems)
        assert report.HasField("store_chain") and report.store_chain.ok and report.anchors >= 3
    finally:
        again.stop()


def test_bad_policies_store_nothing_and_a_restart_succeeds(tmp_path: Path) -> None:
    _scenario(tmp_path, None)


def test_bad_policies_store_nothing_and_a_restart_succeeds_postgres(
    tmp_path: Path, postgres_url: str
) -> None:
    _scenario(tmp_path, postgres_url)
