"""Cache segments record the numerics profile their chunks were computed under, so a turn that finds a
session's KV under another profile can say which (a miss, never a hit).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Rows written before this revision name no profile: "" (their fingerprints predate the schema too,
    # so no node of this version computes a matching one).
    with op.batch_alter_table("cache_segments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("numerics", sa.String(length=256), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("cache_segments", schema=None) as batch_op:
        batch_op.drop_column("numerics")
