"""Conversions between protobuf messages and our domain objects, at the servicer edge only."""

from __future__ import annotations

import datetime as dt
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from orchestrator.api.stubs import Stubs
from orchestrator.api.turn_types import FinishReason, PlanEvent, TokenChunkEvent, TurnStatsEvent
from orchestrator.db.models import MapperRow, SessionRow, SessionStatus
from orchestrator.db.repositories import EffectivePolicy, MapperRegistration
from orchestrator.planner import TokenCounts
from storage import AuditRecord

__all__ = ["Converter"]


def _ts(value: dt.datetime) -> Timestamp:
    out = Timestamp()
    out.FromDatetime(value)
    return out


class Converter:
    """Builds messages of the loaded stubs; one instance per server."""

    def __init__(self, stubs: Stubs) -> None:
        self.pb = stubs

    def session(self, row: SessionRow) -> Any:
        c = self.pb.common
        msg = c.Session(
            session_id=row.id,
            tenant_id=row.tenant_id,
            model=row.model,
            status=c.SESSION_STATUS_OPEN if row.status == SessionStatus.OPEN else c.SESSION_STATUS_CLOSED,
            turn_count=row.turn_count,
            history_tokens=row.history_tokens,
            retention_s=row.retention_s,
            parent_session_id=row.parent_session_id or "",
            created_at=_ts(row.created_at),
            updated_at=_ts(row.updated_at),
        )
        if row.forked_at_turn is not None:
            msg.forked_at_turn = row.forked_at_turn
        return msg

    def counts(self, counts: TokenCounts) -> Any:
        return self.pb.common.TokenCounts(
            cached=counts.cached,
            replayed_encoder=counts.replayed_encoder,
            replayed_decoder=counts.replayed_decoder,
            prefilled=counts.prefilled,
            mapped=counts.mapped,
        )

    def turn_event(self, event: PlanEvent | TokenChunkEvent | TurnStatsEvent, *, request_id: str = "") -> Any:
        s = self.pb.sessions
        if isinstance(event, PlanEvent):
            p = event.plan
            plan = self.pb.common.Plan(
                path=self.pb.common.ResumePath.Value(f"RESUME_PATH_{p.path}"),
                model=p.model,
                reason=p.reason,
                reason_code=self.pb.common.PlanReason.Value(f"PLAN_REASON_{p.reason_code}"),
                prompt_tokens=p.counts.prompt_tokens,
                counts=self.counts(p.counts),
                source_model=p.source_model or "",
                mapper_id=p.mapper_id or "",
                persist=p.persist,
                persist_note=p.persist_note,
                turn_index=event.turn_index,
            )
            return s.TurnEvent(plan=plan)
        if isinstance(event, TokenChunkEvent):
            return s.TurnEvent(tokens=s.TokenChunk(ids=list(event.ids), text=event.text))
        finish = {
            FinishReason.LENGTH: s.FINISH_REASON_LENGTH,
            FinishReason.STOP: s.FINISH_REASON_STOP,
            FinishReason.ABORTED: s.FINISH_REASON_ABORTED,
        }[event.finish_reason]
        stats = s.TurnStats(
            turn_index=event.turn_index,
            ttft_s=event.ttft_s,
            decode_tokens_per_s=event.decode_tokens_per_s,
            counts=self.counts(event.counts),
            generated_tokens=event.generated_tokens,
            finish_reason=finish,
            total_s=event.total_s,
            persisted=event.persisted,
            prompt_tokens=event.counts.prompt_tokens,
            stored_tokens=event.stored_tokens,
            kept=event.kept,
            request_id=request_id,
        )
        return s.TurnEvent(stats=stats)

    def retention(self, policy: EffectivePolicy) -> Any:
        return self.pb.admin.RetentionPolicy(
            tenant_id=policy.tenant_id,
            floor_s=policy.floor_s,
            ceiling_s=policy.ceiling_s,
            is_default=policy.is_default,
        )

    def residency(self, policy: EffectivePolicy, *, node_region: str, warn: bool = False) -> Any:
        """The policy as seen from a node in `node_region`; `warn`: say so when it excludes that node."""
        msg = self.pb.admin.ResidencyPolicy(
            tenant_id=policy.tenant_id,
            allowed_regions=list(policy.allowed_regions),
            is_default=policy.is_default,
            node_region=node_region,
        )
        if warn and not policy.may_store_in(node_region):
            msg.warning = (
                f"this node is in region {node_region!r}, which {policy.tenant_id}'s residency "
                f"{sorted(policy.allowed_regions)} excludes: its turns here are served without persisting "
                "(Plan.persist=false); start the node with --region in the list to keep persisting"
            )
        return msg

    def audit_record(self, rec: AuditRecord) -> Any:
        return self.pb.admin.AuditRecord(
            seq=rec.seq,
            ts_us=rec.ts_us,
            actor=rec.actor,
            action=str(rec.action),
            tenant=rec.tenant,
            subject=rec.subject,
            reason=rec.reason,
            nbytes=rec.nbytes,
            prev_hash=rec.prev_hash,
            hash=rec.hash,
        )

    def mapper(self, row: MapperRow) -> Any:
        msg = self.pb.mappers.Mapper(
            mapper_id=row.id,
            sender_model=row.sender_model,
            receiver_model=row.receiver_model,
            artifact_uri=row.artifact_uri,
            artifact_sha256=row.artifact_sha256,
            kind=row.kind,
            metrics=dict(row.metrics),
            gate_metric=row.gate_metric,
            passed_gate=row.passed_gate,
            created_at=_ts(row.created_at),
        )
        if row.gate_threshold is not None:
            msg.gate_threshold = row.gate_threshold
        return msg

    @staticmethod
    def mapper_registration(msg: Any) -> MapperRegistration:
        return MapperRegistration(
            mapper_id=msg.mapper_id,
            sender_model=msg.sender_model,
            receiver_model=msg.receiver_model,
            artifact_uri=msg.artifact_uri,
            artifact_sha256=msg.artifact_sha256,
            kind=msg.kind or "ridge",
            metrics=dict(msg.metrics),
            gate_metric=msg.gate_metric,
            gate_threshold=msg.gate_threshold if msg.HasField("gate_threshold") else None,
            passed_gate=msg.passed_gate,
        )
