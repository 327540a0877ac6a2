"""Mapper fitting jobs: one row per job (pair, calibration source, token budget, gate settings, phase,
progress, outcome), so a job outlives the node that ran it and a restart can mark it failed.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "fit_jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("sender_model", sa.String(length=128), nullable=False),
        sa.Column("receiver_model", sa.String(length=128), nullable=False),
        sa.Column("source", sa.JSON(), nullable=False),
        sa.Column("budget_tokens", sa.Integer(), nullable=False),
        sa.Column("gate", sa.JSON(), nullable=False),
        sa.Column("mapper_id", sa.String(length=128), nullable=False),
        sa.Column(
            "phase",
            sa.Enum(
                "QUEUED",
                "RUNNING",
                "EVALUATING",
                "SUCCEEDED",
                "REJECTED",
                "FAILED",
                "CANCELLED",
                name="fit_job_phase",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("rows_done", sa.Integer(), nullable=False),
        sa.Column("rows_total", sa.Integer(), nullable=False),
        sa.Column("eta_s", sa.Float(), nullable=True),
        sa.Column("artifact_uri", sa.Text(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("passed_gate", sa.Boolean(), nullable=True),
        sa.Column("resubmitted_from", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_fit_jobs")),
    )
    with op.batch_alter_table("fit_jobs", schema=None) as batch_op:
        batch_op.create_index("ix_fit_jobs_node_phase", ["node", "phase"], unique=False)
        batch_op.create_index("ix_fit_jobs_created", ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("fit_jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_fit_jobs_created")
        batch_op.drop_index("ix_fit_jobs_node_phase")
    op.drop_table("fit_jobs")
