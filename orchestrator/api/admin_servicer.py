"""The Admin service: retention and residency policy, purge, audit query and verify, store statistics.

Every call needs the admin token; every change appends an audit record in the same transaction.
"""

from __future__ import annotations

import math
from typing import Any

import grpc
import structlog
from sqlalchemy import func, select

from orchestrator.api.context import ServiceContext
from orchestrator.api.errors import InvalidRequestError, NotFoundError, UnavailableError, check_name_length
from orchestrator.api.status_table import unary_errors
from orchestrator.db import (
    AuditChecker,
    EffectivePolicy,
    PolicyRepository,
    SegmentRepository,
    TenantRepository,
    heads_digest,
    run_serializable,
)
from orchestrator.db.models import SessionRow, Tenant
from storage import AuditAction, AuditEvent

__all__ = ["AdminServicer", "servicer_class"]

log = structlog.get_logger(__name__)

_DEFAULT_AUDIT_PAGE = 100
_MAX_AUDIT_PAGE = 10000
_MAX_SQL_INT = (1 << 63) - 1
# Region labels one residency policy may list (a policy is one row; labels are short names).
_MAX_REGIONS = 64


def servicer_class(ctx: ServiceContext) -> type:
    return type("AdminServicer", (AdminServicer, ctx.stubs.admin_grpc.AdminServicer), {})


class AdminServicer:
    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._pb = ctx.stubs.admin

    def _effective(self, s: Any, tenant_id: str) -> EffectivePolicy:
        settings = self._ctx.settings
        return PolicyRepository(s).effective(
            tenant_id,
            default_floor_s=settings.retention_floor_s,
            default_ceiling_s=settings.retention_ceiling_s,
        )

    @staticmethod
    def _tenant_id(value: str) -> str:
        if not value:
            raise InvalidRequestError("tenant_id is required", field="tenant_id")
        check_name_length("tenant_id", value)
        return value

    @staticmethod
    def _check_retention(floor_s: float, ceiling_s: float) -> None:
        """Every float finite and in range, before anything is written (an inf or NaN row would be
        refused by the store at every later start, and SQLite stores NaN as NULL)."""
        if not (math.isfinite(floor_s) and floor_s >= 0):
            raise InvalidRequestError(f"floor_s={floor_s} must be finite and >= 0", field="floor_s")
        if not (math.isfinite(ceiling_s) and ceiling_s > 0):
            raise InvalidRequestError(f"ceiling_s={ceiling_s} must be finite and > 0", field="ceiling_s")

    @staticmethod
    def _check_regions(regions: list[str]) -> None:
        if len(regions) > _MAX_REGIONS:
            raise InvalidRequestError(
                f"allowed_regions lists {len(regions)} labels, more than {_MAX_REGIONS}",
                field="allowed_regions",
            )
        for region in regions:
            if not region:
                raise InvalidRequestError("allowed_regions contains an empty label", field="allowed_regions")
            check_name_length("allowed_regions", region)

    @unary_errors
    def GetRetentionPolicy(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        with self._ctx.sessions() as s:
            return self._ctx.convert.retention(self._effective(s, self._tenant_id(request.tenant_id)))

    @unary_errors
    def GetResidencyPolicy(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        with self._ctx.sessions() as s:
            policy = self._effective(s, self._tenant_id(request.tenant_id))
        return self._ctx.convert.residency(policy, node_region=self._ctx.settings.region, warn=True)

    def _set_policy(
        self,
        context: grpc.ServicerContext,
        tenant_id: str,
        *,
        retention: tuple[float, float] | None,
        regions: list[str] | None,
    ) -> EffectivePolicy:
        caller = self._ctx.auth.admin(context)
        tenant_id = self._tenant_id(tenant_id)
        if retention is not None:
            self._check_retention(*retention)
        if regions is not None:
            self._check_regions(regions)
        prior: list[tuple[float, float, list[str]] | None] = []

        def work(s: Any) -> EffectivePolicy:
            TenantRepository(s).ensure(tenant_id)
            row = PolicyRepository(s).get(tenant_id)
            prior[:] = [
                None if row is None
                else (row.retention_floor_s, row.retention_ceiling_s, list(row.allowed_regions))
            ]
            current = self._effective(s, tenant_id)
            floor, ceiling = retention if retention is not None else (current.floor_s, current.ceiling_s)
            allowed = regions if regions is not None else list(current.allowed_regions)
            PolicyRepository(s).set(tenant_id, floor_s=floor, ceiling_s=ceiling, allowed_regions=allowed)
            # The store accepts the policy before SQL commits: a policy it refuses rolls this back.
            if self._ctx.check_policy is not None:
                self._ctx.check_policy(self._effective(s, tenant_id))
            what = (
                f"retention:floor_s={floor:g},ceiling_s={ceiling:g}"
                if retention is not None
                else f"residency:{','.join(sorted(set(allowed))) or '*'}"
            )
            self._ctx.audit.append_in(
                s,
                [
                    AuditEvent(
                        actor=caller.actor,
                        action=AuditAction.POLICY_CHANGE,
                        tenant=tenant_id,
                        subject=what,
                        reason="admin_request",
                    )
                ],
            )
            return self._effective(s, tenant_id)

        policy = run_serializable(self._ctx.serializable, work)
        if self._ctx.on_policy_change is not None:
            try:
                self._ctx.on_policy_change(policy, caller.actor)
            except Exception as exc:
                # The store failed to apply what it accepted (a closed store, a full disk): put SQL back
                # as it was, so that both keep the old policy and the caller can retry.
                self._restore_policy(tenant_id, prior[0] if prior else None, caller.actor, exc)
                raise UnavailableError(
                    f"the store could not apply the policy of tenant {tenant_id!r} (the registry keeps the "
                    f"previous one): {exc}"
                ) from exc
        return policy

    def _restore_policy(
        self, tenant_id: str, prior: tuple[float, float, list[str]] | None, actor: str, exc: Exception
    ) -> None:
        def work(s: Any) -> None:
            repo = PolicyRepository(s)
            if prior is None:
                row = repo.get(tenant_id)
                if row is not None:
                    s.delete(row)
                    s.flush()
                what = "restored:default"
            else:
                floor, ceiling, regions = prior
                repo.set(tenant_id, floor_s=floor, ceiling_s=ceiling, allowed_regions=regions)
                what = f"restored:floor_s={floor:g},ceiling_s={ceiling:g},regions={','.join(regions) or '*'}"
            self._ctx.audit.append_in(
                s,
                [
                    AuditEvent(
                        actor=actor,
                        action=AuditAction.POLICY_CHANGE,
                        tenant=tenant_id,
                        subject=what,
                        reason="store_apply_failed",
                    )
                ],
            )

        run_serializable(self._ctx.serializable, work)
        log.error("policy_change_reverted", tenant=tenant_id, error=str(exc))

    @unary_errors
    def SetRetentionPolicy(self, request: Any, context: grpc.ServicerContext) -> Any:
        policy = self._set_policy(
            context, request.tenant_id, retention=(request.floor_s, request.ceiling_s), regions=None
        )
        return self._ctx.convert.retention(policy)

    @unary_errors
    def SetResidencyPolicy(self, request: Any, context: grpc.ServicerContext) -> Any:
        policy = self._set_policy(
            context, request.tenant_id, retention=None, regions=list(request.allowed_regions)
        )
        return self._ctx.convert.residency(policy, node_region=self._ctx.settings.region, warn=True)

    @unary_errors
    def Purge(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.admin(context)
        # Bounded before anything is looked up or audited (an audit record names the target).
        for name in ("session_id", "tenant_id", "model", "model_tenant_id"):
            check_name_length(name, getattr(request, name))
        target = request.WhichOneof("target")
        purger = self._ctx.purger
        if target == "session_id" and request.session_id:
            for_session = purger.purge_session(
                request.session_id, tenant_id=None, actor=caller.actor, reason="admin_request"
            )
            if for_session is None:
                raise NotFoundError(f"session {request.session_id} not found")
            outcome = for_session
        elif target == "tenant_id" and request.tenant_id:
            outcome = purger.purge_tenant(request.tenant_id, actor=caller.actor, reason="admin_request")
        elif target == "model" and request.model:
            outcome = purger.purge_model(
                request.model,
                tenant_id=request.model_tenant_id or None,
                actor=caller.actor,
                reason="admin_request",
            )
        else:
            raise InvalidRequestError("purge needs one non-empty target: session_id, tenant_id or model")
        return self._pb.PurgeResponse(
            sessions_deleted=outcome.sessions_deleted,
            segments_deleted=outcome.segments_deleted,
            bytes_deleted=outcome.bytes_deleted,
        )

    @unary_errors
    def QueryAudit(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        for name in ("tenant_id", "chain", "action"):
            check_name_length(name, getattr(request, name))
        # SQL integers are signed 64-bit: a larger uint64 would overflow in the query.
        if request.after_seq > _MAX_SQL_INT:
            raise InvalidRequestError(
                f"after_seq={request.after_seq} exceeds {_MAX_SQL_INT}", field="after_seq"
            )
        limit = request.limit or _DEFAULT_AUDIT_PAGE
        if limit > _MAX_AUDIT_PAGE:
            raise InvalidRequestError(f"limit={limit} exceeds {_MAX_AUDIT_PAGE}")
        if request.action and request.action not in {a.value for a in AuditAction}:
            raise InvalidRequestError(f"unknown audit action {request.action!r}")
        found = self._ctx.audit.query_chained(
            tenant=request.tenant_id or None,
            chain=request.chain if request.HasField("chain") else None,
            action=request.action or None,
            since_us=request.since_us or None,
            until_us=request.until_us or None,
            after_seq=request.after_seq,
            limit=limit,
        )
        records = []
        for chain, record in found:
            msg = self._ctx.convert.audit_record(record)
            msg.chain = chain
            records.append(msg)
        return self._pb.QueryAuditResponse(records=records)

    @unary_errors
    def VerifyAudit(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        checker = self._ctx.audit_checker or AuditChecker(self._ctx.audit)
        report = checker.verify()
        heads: dict[str, tuple[int, str]] = {}
        response = self._pb.VerifyAuditResponse(
            ok=report.ok,
            verdict=report.verdict,
            problems=report.problems,
            anchors=report.anchors,
            store_records_pending=report.store_pending,
        )
        verdicts = [(v, response.chains.add()) for v in report.sql]
        if report.store is not None:
            verdicts.append((report.store, response.store_chain))
        first_break = True
        for v, chain in verdicts:
            chain.chain = v.chain
            chain.ok = v.result.ok
            chain.records = v.result.records
            chain.reason = v.result.reason
            chain.head_seq = v.head_seq
            chain.head_hash = v.head_hash
            if v.result.first_break_seq is not None:
                chain.first_break_seq = v.result.first_break_seq
            if v is report.store:
                continue
            heads[v.chain] = (v.head_seq, v.head_hash)
            response.records += v.result.records
        for v, _ in verdicts:
            if not v.result.ok and first_break:
                first_break = False
                response.reason = v.result.reason
                response.first_break_chain = v.chain
                if v.result.first_break_seq is not None:
                    response.first_break_seq = v.result.first_break_seq
        if first_break and report.problems:
            response.reason = report.problems[0]
        response.head_seq = sum(seq for seq, _ in heads.values())
        response.head_hash = heads_digest(heads)
        return response

    @unary_errors
    def GetStoreStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._ctx.auth.admin(context)
        check_name_length("tenant_id", request.tenant_id)
        tenant = request.tenant_id or None
        with self._ctx.sessions() as s:
            totals = SegmentRepository(s).totals(tenant_id=tenant)
            sessions_q = select(func.count()).select_from(SessionRow)
            tenants_q = select(func.count()).select_from(Tenant)
            if tenant is not None:
                sessions_q = sessions_q.where(SessionRow.tenant_id == tenant)
                tenants_q = tenants_q.where(Tenant.id == tenant)
            sessions = s.scalar(sessions_q) or 0
            tenants = s.scalar(tenants_q) or 0
        pool = self._ctx.pool_stats() if self._ctx.pool_stats is not None else None
        return self._pb.StoreStats(
            tenants=tenants,
            sessions=sessions,
            segments=totals.segments,
            stored_bytes=totals.bytes,
            stored_tokens=totals.tokens,
            pool_bytes_used=pool.bytes_used if pool else 0,
            pool_budget_bytes=pool.budget_bytes if pool else self._ctx.settings.pool_budget_bytes,
            pool_entries=pool.entries if pool else 0,
            region=self._ctx.settings.region,
        )
