"""SQLAlchemy 2.0 typed models of the session registry: the SQL schema that migrations/ versions.

Knows nothing of gRPC or the model; repositories in this package are the only writers.
Timestamps are timezone-aware UTC; token histories are little-endian uint32 blobs (see `tokens_to_blob`).
"""

from __future__ import annotations

import datetime as dt
import enum
import sys
from array import array

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

__all__ = [
    "Base",
    "metadata",
    "NAMING_CONVENTION",
    "UtcDateTime",
    "ResumePathName",
    "SessionStatus",
    "TurnStatus",
    "Tenant",
    "Policy",
    "SessionRow",
    "TurnRow",
    "CacheSegment",
    "SessionSegment",
    "MapperRow",
    "FitJobPhase",
    "FitJobRow",
    "AuditRow",
    "AuditHead",
    "tokens_to_blob",
    "blob_to_tokens",
    "utcnow",
]

# Named constraints from day one so that Alembic can drop them on every backend (STYLE rule 18).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UtcDateTime(TypeDecorator[dt.datetime]):
    """A DateTime that always returns aware UTC values (SQLite drops the zone, PostgreSQL keeps it)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r} given where UTC is required")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: object) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def tokens_to_blob(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Pack token ids as little-endian uint32 (4 bytes per token)."""
    packed = array("I", tokens)
    assert packed.itemsize == 4
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def blob_to_tokens(blob: bytes) -> list[int]:
    """Inverse of `tokens_to_blob`."""
    if len(blob) % 4:
        raise ValueError(f"token blob of {len(blob)} bytes is not a multiple of 4")
    packed = array("I")
    packed.frombytes(blob)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


class ResumePathName(enum.StrEnum):
    """The four resume paths of ARCHITECTURE §1, as stored in `turns.path`."""

    FULL_HIT = "FULL_HIT"
    GLOBAL_REPLAY = "GLOBAL_REPLAY"
    COLD_PREFILL = "COLD_PREFILL"
    MODEL_SWAP = "MODEL_SWAP"


class SessionStatus(enum.StrEnum):
    OPEN = "open"
    CLOSED = "closed"


class TurnStatus(enum.StrEnum):
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"


class Base(DeclarativeBase):
    metadata = metadata
    type_annotation_map = {dt.datetime: UtcDateTime()}


class Tenant(Base):
    """A tenant; `salt` keys its stored chunks and never leaves the server."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    salt: Mapped[bytes] = mapped_column(LargeBinary(32))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Policy(Base):
    """A tenant's retention and residency policy; absent rows mean the settings' defaults."""

    __tablename__ = "policies"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    retention_floor_s: Mapped[float] = mapped_column(Float)
    retention_ceiling_s: Mapped[float] = mapped_column(Float)
    # Regions where the tenant's KV may be stored; an empty list means "anywhere".
    allowed_regions: Mapped[list[str]] = mapped_column(JSON, default=list)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class SessionRow(Base):
    """A session: an ordered token history of one tenant, served by one model at a time."""

    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(128))
    status: Mapped[SessionStatus] = mapped_column(
        Enum(SessionStatus, name="session_status", native_enum=False, length=16), default=SessionStatus.OPEN
    )
    parent_session_id: Mapped[str | None] = mapped_column(String(64), default=None)
    forked_at_turn: Mapped[int | None] = mapped_column(Integer, default=None)
    history_tokens: Mapped[int] = mapped_column(Integer, default=0)
    turn_count: Mapped[int] = mapped_column(Integer, default=0)
    retention_hint_s: Mapped[float | None] = mapped_column(Float, default=None)
    retention_s: Mapped[float] = mapped_column(Float)
    # Node and region holding the session's cache; a session whose node is gone resumes cold elsewhere.
    node: Mapped[str] = mapped_column(String(128), default="")
    region: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    turns: Mapped[list[TurnRow]] = relationship(
        back_populates="session", cascade="all, delete-orphan", passive_deletes=True, order_by="TurnRow.index"
    )


class TurnRow(Base):
    """One turn: the tokens it appended and generated, the path taken with its reason, counts and timings."""

    __tablename__ = "turns"
    __table_args__ = (UniqueConstraint("session_id", "index", name="uq_turns_session_id_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(128))
    status: Mapped[TurnStatus] = mapped_column(
        Enum(TurnStatus, name="turn_status", native_enum=False, length=16), default=TurnStatus.RUNNING
    )
    path: Mapped[ResumePathName | None] = mapped_column(
        Enum(ResumePathName, name="resume_path", native_enum=False, length=16), default=None
    )
    reason: Mapped[str] = mapped_column(Text, default="")
    input_tokens: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    output_tokens: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    cached: Mapped[int] = mapped_column(Integer, default=0)
    replayed_encoder: Mapped[int] = mapped_column(Integer, default=0)
    replayed_decoder: Mapped[int] = mapped_column(Integer, default=0)
    prefilled: Mapped[int] = mapped_column(Integer, default=0)
    mapped: Mapped[int] = mapped_column(Integer, default=0)
    ttft_s: Mapped[float | None] = mapped_column(Float, default=None)
    decode_tokens_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    total_s: Mapped[float | None] = mapped_column(Float, default=None)
    persisted: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    session: Mapped[SessionRow] = relationship(back_populates="turns")


class CacheSegment(Base):
    """A durably stored chunk of global KV: which store key holds which positions, for which model/tenant.

    A row is inserted only after the store reports the write durable; a chunk shared by sessions of one
    tenant has one row and one `SessionSegment` link per session.
    """

    __tablename__ = "cache_segments"
    __table_args__ = (Index("ix_cache_segments_tenant_model", "tenant_id", "model"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    store_key: Mapped[bytes] = mapped_column(LargeBinary(256), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(128))
    fingerprint: Mapped[str] = mapped_column(String(128))
    # The numerics profile's label (model.NumericsProfile.label) the chunks were computed under; the
    # fingerprint covers it, this names it in miss reasons.
    numerics: Mapped[str] = mapped_column(String(256), default="", server_default="")
    start_pos: Mapped[int] = mapped_column(Integer)
    end_pos: Mapped[int] = mapped_column(Integer)
    nbytes: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(128), default="")
    region: Mapped[str] = mapped_column(String(64), default="")
    stored_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column()


class SessionSegment(Base):
    """Link from a session to a segment it needs (a segment lives while any link remains)."""

    __tablename__ = "session_segments"

    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    segment_id: Mapped[int] = mapped_column(
        ForeignKey("cache_segments.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class MapperRow(Base):
    """A registered cross-model KV mapper artifact with its quality figures and gate verdict."""

    __tablename__ = "mappers"
    __table_args__ = (Index("ix_mappers_pair", "sender_model", "receiver_model"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    sender_model: Mapped[str] = mapped_column(String(128))
    receiver_model: Mapped[str] = mapped_column(String(128))
    artifact_uri: Mapped[str] = mapped_column(Text)
    artifact_sha256: Mapped[str] = mapped_column(String(64), default="")
    kind: Mapped[str] = mapped_column(String(32), default="ridge")
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    gate_metric: Mapped[str] = mapped_column(String(64), default="")
    gate_threshold: Mapped[float | None] = mapped_column(Float, default=None)
    passed_gate: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class FitJobPhase(enum.StrEnum):
    """A mapper fitting job's phase, as stored in `fit_jobs.phase`; the last four are final."""

    QUEUED = "queued"
    RUNNING = "running"
    EVALUATING = "evaluating"
    SUCCEEDED = "succeeded"
    REJECTED = "rejected"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in _FINAL_FIT_PHASES


_FINAL_FIT_PHASES = frozenset(
    {FitJobPhase.SUCCEEDED, FitJobPhase.REJECTED, FitJobPhase.FAILED, FitJobPhase.CANCELLED}
)


class FitJobRow(Base):
    """A mapper fitting job: what was asked (pair, calibration source, token budget, gate), where it
    stands (phase, rows done of total, ETA) and how it ended (reason, figures, the mapper it registered).

    `node` is the node that runs it: a node starting up fails its own QUEUED/RUNNING/EVALUATING rows
    ("node restarted"), since their child process died with it; a resubmission is a new row naming the
    old one in `resubmitted_from`.
    """

    __tablename__ = "fit_jobs"
    __table_args__ = (
        Index("ix_fit_jobs_node_phase", "node", "phase"),
        Index("ix_fit_jobs_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    actor: Mapped[str] = mapped_column(String(128), default="")
    node: Mapped[str] = mapped_column(String(128), default="")
    sender_model: Mapped[str] = mapped_column(String(128))
    receiver_model: Mapped[str] = mapped_column(String(128))
    # The calibration source as submitted (kind plus its fields) and the gate settings, as JSON objects.
    source: Mapped[dict[str, object]] = mapped_column(JSON, default=dict)
    budget_tokens: Mapped[int] = mapped_column(Integer)
    gate: Mapped[dict[str, object]] = mapped_column(JSON, default=dict)
    mapper_id: Mapped[str] = mapped_column(String(128), default="")
    phase: Mapped[FitJobPhase] = mapped_column(
        Enum(FitJobPhase, name="fit_job_phase", native_enum=False, length=16), default=FitJobPhase.QUEUED
    )
    reason: Mapped[str] = mapped_column(Text, default="")
    rows_done: Mapped[int] = mapped_column(Integer, default=0)
    rows_total: Mapped[int] = mapped_column(Integer, default=0)
    eta_s: Mapped[float | None] = mapped_column(Float, default=None)
    artifact_uri: Mapped[str] = mapped_column(Text, default="")
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    passed_gate: Mapped[bool | None] = mapped_column(Boolean, default=None)
    resubmitted_from: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class AuditRow(Base):
    """One record of an authoritative audit chain: one chain per tenant (`chain` = the record's tenant),
    plus the node-wide chain `""` for records of no tenant and for every record written before the
    chains were split; `seq` is dense from 1 within each chain.

    Columns are the fields of storage's `AuditRecord` (same canonical body, same `chain_hash`), so a row
    converts to a record and back without loss and `storage.verify_chain` checks each chain, plus
    `chain` and `source_hash` (the hash of the store's own record this row mirrors, None for records
    born in SQL), which lets a re-delivered store record be recognised and skipped.
    """

    __tablename__ = "audit_log"

    chain: Mapped[str] = mapped_column(String(128), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    ts_us: Mapped[int] = mapped_column(BigInteger, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(32), index=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    subject: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    nbytes: Mapped[int] = mapped_column(BigInteger)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    source_hash: Mapped[str | None] = mapped_column(String(64), unique=True, default=None)


class AuditHead(Base):
    """A chain's head (last seq and hash), kept apart from the records so truncation is detectable.

    One row per chain, created with the chain's first record (the node-wide chain `""` by the first
    migration); every append locks and moves its chain's row, and no other chain's.
    """

    __tablename__ = "audit_head"

    chain: Mapped[str] = mapped_column(String(128), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger)
    hash: Mapped[str] = mapped_column(String(64))
