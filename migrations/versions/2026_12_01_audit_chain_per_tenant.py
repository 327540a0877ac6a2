"""One audit chain per tenant: `audit_log` rows carry their chain (the record's tenant, `""` for records
of no tenant and for every record written before this revision, which keep their seq and hashes) and
the hash of the store record they mirror; `audit_head` holds one head per chain.

Downgrade merges every chain back into one, in (ts_us, chain, seq) order, re-sealing seq and hashes
(the previous schema has one chain per database); the records' contents are kept.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 13:40:00
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# storage's GENESIS_HASH (migrations may not import storage/).
_GENESIS = "0" * 64
_BODY = ("seq", "ts_us", "actor", "action", "tenant", "subject", "reason", "nbytes", "prev_hash")


def upgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.add_column(sa.Column("chain", sa.String(length=128), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("source_hash", sa.String(length=64), nullable=True))
        batch_op.drop_constraint("pk_audit_log", type_="primary")
        batch_op.create_primary_key("pk_audit_log", ["chain", "seq"])
        batch_op.create_unique_constraint(batch_op.f("uq_audit_log_source_hash"), ["source_hash"])
    with op.batch_alter_table("audit_head", schema=None) as batch_op:
        # The one head so far becomes the head of the node-wide chain "".
        batch_op.add_column(sa.Column("chain", sa.String(length=128), nullable=False, server_default=""))
        batch_op.drop_constraint("pk_audit_head", type_="primary")
        batch_op.drop_column("id")
        batch_op.create_primary_key("pk_audit_head", ["chain"])


def _seal(row: dict[str, object], seq: int, prev: str) -> dict[str, object]:
    """storage's `seal` over an existing row: sha256(prev || canonical JSON of the body)."""
    body = {name: row[name] for name in _BODY}
    body.update(seq=seq, prev_hash=prev)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return {**body, "hash": hashlib.sha256(bytes.fromhex(prev) + canonical).hexdigest()}


def downgrade() -> None:
    conn = op.get_bind()
    log = sa.table(
        "audit_log",
        *(sa.column(name) for name in (*_BODY, "hash", "chain")),
    )
    rows = [
        dict(r._mapping) for r in conn.execute(sa.select(log).order_by(log.c.ts_us, log.c.chain, log.c.seq))
    ]
    merged: list[dict[str, object]] = []
    prev = _GENESIS
    for i, row in enumerate(rows, start=1):
        sealed = _seal(row, i, prev)
        merged.append(sealed)
        prev = sealed["hash"]  # type: ignore[assignment]
    conn.execute(sa.delete(log))
    conn.execute(sa.delete(sa.table("audit_head")))
    with op.batch_alter_table("audit_head", schema=None) as batch_op:
        batch_op.drop_constraint("pk_audit_head", type_="primary")
        batch_op.drop_column("chain")
        batch_op.add_column(sa.Column("id", sa.Integer(), autoincrement=False, nullable=False))
        batch_op.create_primary_key("pk_audit_head", ["id"])
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_audit_log_source_hash"), type_="unique")
        batch_op.drop_constraint("pk_audit_log", type_="primary")
        batch_op.drop_column("source_hash")
        batch_op.drop_column("chain")
        batch_op.create_primary_key("pk_audit_log", ["seq"])
    old_log = sa.table("audit_log", *(sa.column(name) for name in (*_BODY, "hash")))
    if merged:
        op.bulk_insert(old_log, merged)  # type: ignore[arg-type]
    head = sa.table("audit_head", sa.column("id", sa.Integer), sa.column("seq"), sa.column("hash"))
    op.bulk_insert(head, [{"id": 1, "seq": len(merged), "hash": prev}])
