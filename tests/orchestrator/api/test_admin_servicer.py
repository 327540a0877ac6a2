"""Admin and Mappers over real gRPC: policies with audit records, purges, audit verify, stats, mappers."""

from __future__ import annotations

import datetime as dt

import grpc
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from orchestrator.db import DurableSegment, SegmentRepository
from orchestrator.db.models import AuditRow
from tests.orchestrator.api.conftest import ADMIN_TOKEN, bearer

ADMIN = bearer(ADMIN_TOKEN)


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value.code()


def _session_with_segment(service, token: str, tenant: str, key: bytes, model: str = "small") -> str:
    pb = service.pb
    sid = (
        service.sessions()
        .CreateSession(pb.sessions.CreateSessionRequest(model=model), metadata=bearer(token))
        .session.session_id
    )
    with service.ctx.sessions() as s, s.begin():
        SegmentRepository(s).link(
            sid,
            DurableSegment(
                store_key=key,
                tenant_id=tenant,
                model=model,
                fingerprint=f"fp-{model}",
                start_pos=0,
                end_pos=256,
                nbytes=256 * 890,
                expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
            ),
        )
    return sid


def test_policies_round_trip_and_are_audited(service) -> None:
    pb, admin = service.pb, service.admin()
    default = admin.GetRetentionPolicy(pb.admin.TenantRef(tenant_id="umbrella"), metadata=ADMIN)
    assert default.is_default and default.ceiling_s == service.ctx.settings.retention_ceiling_s
    applied = []
    service.ctx.on_policy_change = lambda policy, actor: applied.append((policy.ceiling_s, actor))
    try:
        got = admin.SetRetentionPolicy(
            pb.admin.RetentionPolicy(tenant_id="umbrella", floor_s=7200, ceiling_s=3600), metadata=ADMIN
        )
    finally:
        service.ctx.on_policy_change = None
    assert applied == [(3600, "admin")]
    # The ceiling wins over a larger floor (ARCHITECTURE §4).
    assert (got.floor_s, got.ceiling_s, got.is_default) == (3600, 3600, False)
    res = admin.SetResidencyPolicy(
        pb.admin.ResidencyPolicy(tenant_id="umbrella", allowed_regions=["us-1", "eu-1"]), metadata=ADMIN
    )
    assert list(res.allowed_regions) == ["eu-1", "us-1"]
    # Setting residency leaves retention alone.
    assert (
        admin.GetRetentionPolicy(pb.admin.TenantRef(tenant_id="umbrella"), metadata=ADMIN).ceiling_s == 3600
    )
    assert (
        _code(
            admin.SetRetentionPolicy,
            pb.admin.RetentionPolicy(tenant_id="umbrella", floor_s=0, ceiling_s=0),
            metadata=ADMIN,
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    audit = admin.QueryAudit(
        pb.admin.QueryAuditRequest(tenant_id="umbrella", action="policy_change"), metadata=ADMIN
    )
    assert [r.subject for r in audit.records] == [
        "retention:floor_s=7200,ceiling_s=3600",
        "residency:eu-1,us-1",
    ]
    assert all(r.actor == "admin" and len(r.hash) == 64 for r in audit.records)


def test_purge_tenant_and_model_then_verify_audit(service) -> None:
    pb, admin = service.pb, service.admin()
    keep = _session_with_segment(service, "tok-globex", "globex", b"g-1", model="large")
    _session_with_segment(service, "tok-initech", "initech", b"i-1", model="small")
    _session_with_segment(service, "tok-initech", "initech", b"i-2", model="small")
    stats = admin.GetStoreStats(pb.admin.StoreStatsRequest(tenant_id="initech"), metadata=ADMIN)
    assert (stats.segments, stats.stored_bytes, stats.stored_tokens) == (2, 2 * 256 * 890, 512)
    everything = admin.GetStoreStats(pb.admin.StoreStatsRequest(), metadata=ADMIN).stored_bytes
    assert f"kvresume_stored_bytes {float(everything)}" in service.ctx.metrics.exposition().decode()
    out = admin.Purge(pb.admin.PurgeRequest(tenant_id="initech"), metadata=ADMIN)
    assert (out.segments_deleted, out.bytes_deleted) == (2, 2 * 256 * 890) and out.sessions_deleted >= 2
    stats = admin.GetStoreStats(pb.admin.StoreStatsRequest(tenant_id="initech"), metadata=ADMIN)
    assert (stats.sessions, stats.segments) == (0, 0)
    out = admin.Purge(pb.admin.PurgeRequest(model="large"), metadata=ADMIN)
    assert (out.sessions_deleted, out.segments_deleted) == (0, 1)
    # The session survives a model purge (it will resume cold); its segment does not.
    got = service.sessions().GetSession(
        pb.sessions.GetSessionRequest(session_id=keep), metadata=bearer("tok-globex")
    )
    assert got.session_id == keep
    assert _code(admin.Purge, pb.admin.PurgeRequest(), metadata=ADMIN) == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        _code(admin.Purge, pb.admin.PurgeRequest(session_id="missing"), metadata=ADMIN)
        == grpc.StatusCode.NOT_FOUND
    )
    subjects = [
        r.subject
        for r in admin.QueryAudit(
            pb.admin.QueryAuditRequest(action="purge", limit=1000), metadata=ADMIN
        ).records
    ]
    assert subjects[-2:] == ["tenant:initech", "model:large"]
    verdict = admin.VerifyAudit(pb.admin.VerifyAuditRequest(), metadata=ADMIN)
    assert verdict.ok and verdict.records == verdict.head_seq and not verdict.HasField("first_break_seq")


def test_verify_audit_reports_a_tampered_record(tmp_path) -> None:
    from orchestrator.api import build_context, build_server
    from tests.orchestrator.api.conftest import make_settings

    ctx = build_context(make_settings(tmp_path))
    running = build_server(ctx, host="127.0.0.1", port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            admin = ctx.stubs.admin_grpc.AdminStub(channel)
            for ceiling in (100, 200, 300):
                admin.SetRetentionPolicy(
                    ctx.stubs.admin.RetentionPolicy(tenant_id="acme", floor_s=1, ceiling_s=ceiling),
                    metadata=ADMIN,
                )
            with Session(ctx.engine) as s, s.begin():
                s.execute(update(AuditRow).where(AuditRow.seq == 2).values(subject="retention:forged"))
            verdict = admin.VerifyAudit(ctx.stubs.admin.VerifyAuditRequest(), metadata=ADMIN)
            assert (verdict.ok, verdict.first_break_seq, verdict.reason) == (False, 2, "hash mismatch")
    finally:
        running.stop(grace_s=None)
        ctx.close()


def test_mappers_register_list_get(service) -> None:
    pb, stub = service.pb, service.mappers()
    good = pb.mappers.Mapper(
        mapper_id="small-to-large-v1",
        sender_model="small",
        receiver_model="large",
        artifact_uri="file:///m/v1.safetensors",
        metrics={"retention": 0.93, "cosine": 0.98},
        gate_metric="retention",
        gate_threshold=0.9,
        passed_gate=True,
    )
    req = pb.mappers.RegisterMapperRequest(mapper=good)
    assert _code(stub.RegisterMapper, req, metadata=bearer("tok-acme")) == grpc.StatusCode.PERMISSION_DENIED
    got = stub.RegisterMapper(req, metadata=ADMIN)
    assert got.passed_gate and got.metrics["retention"] == pytest.approx(0.93)
    liar = pb.mappers.Mapper(
        mapper_id="liar",
        sender_model="small",
        receiver_model="large",
        artifact_uri="x",
        metrics={"retention": 0.5},
        gate_metric="retention",
        gate_threshold=0.9,
        passed_gate=True,
    )
    assert (
        _code(stub.RegisterMapper, pb.mappers.RegisterMapperRequest(mapper=liar), metadata=ADMIN)
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    failing = pb.mappers.Mapper(
        mapper_id="large-to-small-v1",
        sender_model="large",
        receiver_model="small",
        artifact_uri="y",
        metrics={"retention": 0.4},
        gate_metric="retention",
        gate_threshold=0.9,
        passed_gate=False,
    )
    stub.RegisterMapper(pb.mappers.RegisterMapperRequest(mapper=failing), metadata=ADMIN)
    listed = stub.ListMappers(
        pb.mappers.ListMappersRequest(sender_model="small"), metadata=bearer("tok-acme")
    )
    assert [m.mapper_id for m in listed.mappers] == ["small-to-large-v1"]
    assert (
        stub.GetMapper(pb.mappers.GetMapperRequest(mapper_id="large-to-small-v1"), metadata=ADMIN).passed_gate
        is False
    )
    assert (
        _code(stub.GetMapper, pb.mappers.GetMapperRequest(mapper_id="nope"), metadata=ADMIN)
        == grpc.StatusCode.NOT_FOUND
    )


def test_health_and_reflection_list_our_services(service) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(service.channel)
    for name in ("", "kvresume.v1.Sessions", "kvresume.v1.Admin", "kvresume.v1.Mappers"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=name)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    refl = reflection_pb2_grpc.ServerReflectionStub(service.channel)
    responses = list(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in responses[0].list_services_response.service}
    assert {
        "kvresume.v1.Sessions",
        "kvresume.v1.Admin",
        "kvresume.v1.Mappers",
        "grpc.health.v1.Health",
    } <= names


@pytest.mark.parametrize(
    ("floor_s", "ceiling_s", "named"),
    [
        (1.0, float("inf"), "ceiling_s=inf"),
        (float("inf"), 3600.0, "floor_s=inf"),
        (float("nan"), 3600.0, "floor_s=nan"),
        (1.0, float("nan"), "ceiling_s=nan"),
        (-1.0, 3600.0, "floor_s=-1.0"),
    ],
    ids=["inf-ceiling", "inf-floor", "nan-floor", "nan-ceiling", "negative-floor"],
)
def test_set_retention_policy_rejects_non_finite_values_storing_nothing(
    service, floor_s: float, ceiling_s: float, named: str
) -> None:
    pb, admin = service.pb, service.admin()
    tenant = f"hooli-{named}"
    applied = []
    service.ctx.on_policy_change = lambda policy, actor: applied.append(policy)
    try:
        with pytest.raises(grpc.RpcError) as info:
            admin.SetRetentionPolicy(
                pb.admin.RetentionPolicy(tenant_id=tenant, floor_s=floor_s, ceiling_s=ceiling_s),
                metadata=ADMIN,
            )
    finally:
        service.ctx.on_policy_change = None
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in info.value.details()
    assert applied == []
    got = admin.GetRetentionPolicy(pb.admin.TenantRef(tenant_id=tenant), metadata=ADMIN)
    assert got.is_default
    with service.ctx.sessions() as s:
        assert s.scalars(select(AuditRow).where(AuditRow.tenant == tenant)).all() == []
