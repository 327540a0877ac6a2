"""Initial registry schema: tenants, policies, sessions, turns, cache segments, mappers, audit log.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 11:23:49.687716
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_head")),
    )
    # The empty chain's head: seq 0 and storage's GENESIS_HASH (64 zeros; migrations may not import storage/).
    head = sa.table(
        "audit_head",
        sa.column("id", sa.Integer),
        sa.column("seq", sa.BigInteger),
        sa.column("hash", sa.String),
    )
    op.bulk_insert(head, [{"id": 1, "seq": 0, "hash": "0" * 64}])
    op.create_table(
        "audit_log",
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("ts_us", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_audit_log")),
        sa.UniqueConstraint("hash", name=op.f("uq_audit_log_hash")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_log_action"), ["action"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_log_tenant"), ["tenant"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_log_ts_us"), ["ts_us"], unique=False)

    op.create_table(
        "mappers",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("sender_model", sa.String(length=128), nullable=False),
        sa.Column("receiver_model", sa.String(length=128), nullable=False),
        sa.Column("artifact_uri", sa.Text(), nullable=False),
        sa.Column("artifact_sha256", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("gate_metric", sa.String(length=64), nullable=False),
        sa.Column("gate_threshold", sa.Float(), nullable=True),
        sa.Column("passed_gate", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mappers")),
    )
    with op.batch_alter_table("mappers", schema=None) as batch_op:
        batch_op.create_index("ix_mappers_pair", ["sender_model", "receiver_model"], unique=False)

    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("salt", sa.LargeBinary(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
    )
    op.create_table(
        "cache_segments",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("store_key", sa.LargeBinary(length=256), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("fingerprint", sa.String(length=128), nullable=False),
        sa.Column("start_pos", sa.Integer(), nullable=False),
        sa.Column("end_pos", sa.Integer(), nullable=False),
        sa.Column("nbytes", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("stored_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_cache_segments_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cache_segments")),
        sa.UniqueConstraint("store_key", name=op.f("uq_cache_segments_store_key")),
    )
    with op.batch_alter_table("cache_segments", schema=None) as batch_op:
        batch_op.create_index("ix_cache_segments_tenant_model", ["tenant_id", "model"], unique=False)

    op.create_table(
        "policies",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("retention_floor_s", sa.Float(), nullable=False),
        sa.Column("retention_ceiling_s", sa.Float(), nullable=False),
        sa.Column("allowed_regions", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_policies_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_policies")),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column(
            "status",
            sa.Enum("OPEN", "CLOSED", name="session_status", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("parent_session_id", sa.String(length=64), nullable=True),
        sa.Column("forked_at_turn", sa.Integer(), nullable=True),
        sa.Column("history_tokens", sa.Integer(), nullable=False),
        sa.Column("turn_count", sa.Integer(), nullable=False),
        sa.Column("retention_hint_s", sa.Float(), nullable=True),
        sa.Column("retention_s", sa.Float(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("region", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sessions_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.create_index("ix_sessions_tenant_created", ["tenant_id", "created_at"], unique=False)

    op.create_table(
        "session_segments",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("segment_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["segment_id"],
            ["cache_segments.id"],
            name=op.f("fk_session_segments_segment_id_cache_segments"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_session_segments_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session_id", "segment_id", name=op.f("pk_session_segments")),
    )
    with op.batch_alter_table("session_segments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_session_segments_segment_id"), ["segment_id"], unique=False)

    op.create_table(
        "turns",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column(
            "status",
            sa.Enum("RUNNING", "DONE", "ABORTED", "FAILED", name="turn_status", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column(
            "path",
            sa.Enum(
                "FULL_HIT",
                "GLOBAL_REPLAY",
                "COLD_PREFILL",
                "MODEL_SWAP",
                name="resume_path",
                native_enum=False,
                length=16,
            ),
            nullable=True,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("input_tokens", sa.LargeBinary(), nullable=False),
        sa.Column("output_tokens", sa.LargeBinary(), nullable=False),
        sa.Column("cached", sa.Integer(), nullable=False),
        sa.Column("replayed_encoder", sa.Integer(), nullable=False),
        sa.Column("replayed_decoder", sa.Integer(), nullable=False),
        sa.Column("prefilled", sa.Integer(), nullable=False),
        sa.Column("mapped", sa.Integer(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("decode_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("total_s", sa.Float(), nullable=True),
        sa.Column("persisted", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_turns_session_id_sessions"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_turns")),
        sa.UniqueConstraint("session_id", "index", name="uq_turns_session_id_index"),
    )
    with op.batch_alter_table("turns", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_turns_session_id"), ["session_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("turns", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_turns_session_id"))

    op.drop_table("turns")
    with op.batch_alter_table("session_segments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_session_segments_segment_id"))

    op.drop_table("session_segments")
    with op.batch_alter_table("sessions", schema=None) as batch_op:
        batch_op.drop_index("ix_sessions_tenant_created")

    op.drop_table("sessions")
    op.drop_table("policies")
    with op.batch_alter_table("cache_segments", schema=None) as batch_op:
        batch_op.drop_index("ix_cache_segments_tenant_model")

    op.drop_table("cache_segments")
    op.drop_table("tenants")
    with op.batch_alter_table("mappers", schema=None) as batch_op:
        batch_op.drop_index("ix_mappers_pair")

    op.drop_table("mappers")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_log_ts_us"))
        batch_op.drop_index(batch_op.f("ix_audit_log_tenant"))
        batch_op.drop_index(batch_op.f("ix_audit_log_action"))

    op.drop_table("audit_log")
    op.drop_table("audit_head")
