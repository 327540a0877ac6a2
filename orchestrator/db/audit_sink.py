"""The SQL audit sink: storage's audit record and hash-chain format, kept in the registry database.

One chain per tenant (a record's chain is its tenant), plus the node-wide chain `""` for records of no
tenant and for the records written before the chains were split. Each append locks only its chains'
head rows, seals the next records with `storage.seal`, inserts them and moves the heads, in one
serialisable transaction, so appends of different tenants never wait for each other and several
replicas appending at once still produce gap-free chains. Store records (the store's own chain, via
its `on_audit`) are mirrored with their hash as `source_hash`, so a re-delivered one is skipped.
Knows nothing of what the events describe. Statements are SQLAlchemy Core (the per-turn path).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, bindparam, insert, select, text, update
from sqlalchemy.orm import Session

from orchestrator.db.models import AuditHead, AuditRow
from orchestrator.db.repositories.driver_dml import DriverDML
from orchestrator.db.transactions import connection_of, run_serializable, serializable_factory
from storage import (
    GENESIS_HASH,
    AuditAction,
    AuditEvent,
    AuditRecord,
    AuditSink,
    VerifyResult,
    canonical_json,
    seal,
    verify_chain,
)

__all__ = [
    "NODE_CHAIN",
    "ChainVerdict",
    "SqlAuditSink",
    "chain_of",
    "heads_digest",
    "record_from_row",
    "row_from_record",
]

NODE_CHAIN = ""
"""The chain of records that concern no tenant (and of every record older than the per-tenant chains)."""

_LOG = AuditRow.__table__
_HEAD = AuditHead.__table__
_FIELDS = ("seq", "ts_us", "actor", "action", "tenant", "subject", "reason", "nbytes", "prev_hash", "hash")

# An append's statements, built once (they run in every turn's transaction).
_HEAD_FOR_UPDATE = select(_HEAD.c.seq, _HEAD.c.hash).where(_HEAD.c.chain == bindparam("c")).with_for_update()
_HEAD_NEW = insert(_HEAD)
_HEAD_MOVE = (
    update(_HEAD)
    .where(_HEAD.c.chain == bindparam("c"), _HEAD.c.seq == bindparam("seq0"))
    .values(seq=bindparam("seq1"), hash=bindparam("hash1"))
)
# The same move when the head was not read in this transaction (SQLite's remembered head, `_heads`): it
# matches only a head that is still exactly the one remembered.
_HEAD_MOVE_IF = (
    update(_HEAD)
    .where(
        _HEAD.c.chain == bindparam("c"), _HEAD.c.seq == bindparam("seq0"), _HEAD.c.hash == bindparam("hash0")
    )
    .values(seq=bindparam("seq1"), hash=bindparam("hash1"))
)
_LOG_ADD = insert(_LOG)
# the keys of `row_from_record`'s values (what the driver insert is compiled for)
_ROW_KEYS = (*_FIELDS, "chain", "source_hash")
_SEQSCAN_OFF = text("SET LOCAL enable_seqscan = off")
_SEQSCAN_DEFAULT = text("SET LOCAL enable_seqscan TO DEFAULT")


def record_from_row(row: object) -> AuditRecord:
    """A record from an `AuditRow` or a Core row of `audit_log`."""
    return AuditRecord(
        seq=row.seq,  # type: ignore[attr-defined]
        ts_us=row.ts_us,  # type: ignore[attr-defined]
        actor=row.actor,  # type: ignore[attr-defined]
        action=AuditAction(row.action),  # type: ignore[attr-defined]
        tenant=row.tenant,  # type: ignore[attr-defined]
        subject=row.subject,  # type: ignore[attr-defined]
        reason=row.reason,  # type: ignore[attr-defined]
        nbytes=row.nbytes,  # type: ignore[attr-defined]
        prev_hash=row.prev_hash,  # type: ignore[attr-defined]
        hash=row.hash,  # type: ignore[attr-defined]
    )


def row_from_record(rec: AuditRecord, *, chain: str, source_hash: str | None = None) -> dict[str, object]:
    """The `audit_log` values of a record sealed in `chain`."""
    values: dict[str, object] = {name: getattr(rec, name) for name in _FIELDS}
    values["action"] = str(rec.action)
    values["chain"] = chain
    values["source_hash"] = source_hash
    return values


@dataclass(frozen=True, kw_only=True)
class ChainVerdict:
    """One chain's verification: its head as stored and the walk's result."""

    chain: str
    head_seq: int
    head_hash: str
    result: VerifyResult


def chain_of(tenant: str) -> str:
    """The chain a record of `tenant` belongs to."""
    return tenant


def heads_digest(heads: dict[str, tuple[int, str]]) -> str:
    """sha256 over every chain's head (sorted by chain); GENESIS_HASH when no chain holds a record."""
    live = sorted((c, seq, h) for c, (seq, h) in heads.items() if seq > 0)
    if not live:
        return GENESIS_HASH
    return hashlib.sha256(canonical_json({"heads": [list(h) for h in live]})).hexdigest()


def _seal_chain(
    items: Sequence[tuple[AuditEvent, int, str | None]], indices: list[int], seq0: int, prev: str
) -> list[AuditRecord]:
    """The records of `items[i]` for i in `indices`, sealed in order after the head (seq0, prev)."""
    recs = []
    for seq, i in enumerate(indices, start=seq0 + 1):
        event, ts_us, _ = items[i]
        rec = seal(event, seq=seq, ts_us=ts_us, prev_hash=prev)
        recs.append(rec)
        prev = rec.hash
    return recs


class SqlAuditSink(AuditSink):
    """Append-only, hash-chained audit log in the `audit_log` table (heads in `audit_head`).

    `append` runs its own serialisable transaction with retries; `append_in` and `mirror_in` add
    records to the caller's transaction so that a change and its audit records commit together (the
    caller must run that transaction through `run_serializable`). `mirror` is the store's `on_audit`.
    """

    def __init__(self, engine: Engine, *, clock: Callable[[], float] = time.time, attempts: int = 50) -> None:
        self._engine = engine
        self._factory = serializable_factory(engine)
        self._clock = clock
        self._attempts = attempts
        # SQLite: each chain's head as this sink last moved it (a hint, maybe of a transaction that rolled
        # back, or overtaken by another writer). An append seals after it without reading the head and
        # moves the head only if it is still exactly that; otherwise it reads the head and seals again.
        # One statement fewer in every turn's write transaction, which other turns wait for.
        self._heads: dict[str, tuple[int, str]] = {}
        self.remember_heads = engine.dialect.name == "sqlite"
        # SQLite: the hinted head move and the log insert as driver statements (`DriverDML`, compiled once:
        # the same SQL text and bind processing), run on the transaction's own sqlite3 connection.
        self._driver: tuple[DriverDML, DriverDML] | None = None
        if engine.dialect.name == "sqlite":
            self._driver = (
                DriverDML(_HEAD_MOVE_IF, engine.dialect),
                DriverDML(_LOG_ADD, engine.dialect, keys=_ROW_KEYS),
            )

    def append(self, event: AuditEvent) -> AuditRecord:
        return run_serializable(
            self._factory, lambda s: self.append_in(s, [event])[0], attempts=self._attempts
        )

    def append_many(self, events: Sequence[AuditEvent]) -> list[AuditRecord]:
        return run_serializable(self._factory, lambda s: self.append_in(s, events), attempts=self._attempts)

    def mirror(self, records: AuditRecord | Sequence[AuditRecord]) -> list[AuditRecord]:
        """Append records sealed in the store's chain (its `on_audit`), in one transaction, skipping
        those already mirrored (the store re-delivers what it was never told is held here)."""
        batch = [records] if isinstance(records, AuditRecord) else list(records)
        if not batch:
            return []
        return run_serializable(
            self._factory, lambda s: self.mirror_in(s, batch, skip_known=True), attempts=self._attempts
        )

    def mirror_in(
        self, session: Session | Connection, records: Sequence[AuditRecord], *, skip_known: bool = False
    ) -> list[AuditRecord]:
        """Append store records as the next records of their tenants' chains inside `session`'s
        transaction (a Session's, or a Connection's of `run_serializable_connection`): same fields and
        timestamp, this database's seq and hashes, `source_hash` = the store record's hash.

        Args:
            skip_known: first drop records whose hash is already a `source_hash` here (a delivery
                that may repeat one); records a caller has just claimed from the store need not.
        """
        todo = list(records)
        if skip_known and todo:
            known = set(
                session.scalars(
                    select(_LOG.c.source_hash).where(_LOG.c.source_hash.in_([r.hash for r in todo]))
                )
            )
            todo = [r for r in todo if r.hash not in known]
        items = [
            (
                AuditEvent(
                    actor=r.actor,
                    action=r.action,
                    tenant=r.tenant,
                    subject=r.subject,
                    reason=r.reason,
                    nbytes=r.nbytes,
                ),
                r.ts_us,
                r.hash,
            )
            for r in todo
        ]
        return self._append_items(session, items)

    def append_in(
        self, session: Session, events: Sequence[AuditEvent], *, ts_us: int | None = None
    ) -> list[AuditRecord]:
        """Seal and insert `events` after their chains' heads inside `session`'s transaction."""
        if not events:
            return []
        stamp = int(round(self._clock() * 1_000_000)) if ts_us is None else ts_us
        return self._append_items(session, [(e, stamp, None) for e in events])

    def _append_items(
        self, session: Session | Connection, items: Sequence[tuple[AuditEvent, int, str | None]]
    ) -> list[AuditRecord]:
        if not items:
            return []
        by_chain: dict[str, list[int]] = {}
        for i, (event, _, _) in enumerate(items):
            by_chain.setdefault(chain_of(event.tenant), []).append(i)
        sealed: list[AuditRecord | None] = [None] * len(items)
        rows: list[dict[str, object]] = []
        conn = connection_of(session)
        postgres = conn.dialect.name == "postgresql"
        if postgres:
            # Under SERIALIZABLE a sequential scan of audit_head (the planner's choice while it is small)
            # takes a predicate lock on the whole table, so appends of two tenants would conflict and one
            # be rerun; index scans lock only the chain's own head row.
            conn.execute(_SEQSCAN_OFF)
        # Heads are locked in chain order, so two transactions that touch the same chains cannot
        # deadlock; FOR UPDATE serialises appenders of one chain on PostgreSQL, and under SERIALIZABLE
        # a concurrent head move (or a concurrent first record of a chain) fails one of the two
        # transactions, which run_serializable reruns.
        for chain in sorted(by_chain):
            hint = self._heads.get(chain) if self.remember_heads else None
            if hint is not None:
                recs = _seal_chain(items, by_chain[chain], *hint)
                move = {
                    "c": chain,
                    "seq0": hint[0],
                    "hash0": hint[1],
                    "seq1": recs[-1].seq,
                    "hash1": recs[-1].hash,
                }
                if self._driver is not None:
                    rowcount = self._driver[0].execute(conn.connection.driver_connection, move)
                else:
                    rowcount = conn.execute(_HEAD_MOVE_IF, move).rowcount
                if rowcount == 1:
                    self._keep(chain, items, by_chain[chain], recs, rows, sealed)
                    continue
            head = conn.execute(_HEAD_FOR_UPDATE, {"c": chain}).one_or_none()
            seq0, prev = (head.seq, head.hash) if head is not None else (0, GENESIS_HASH)
            recs = _seal_chain(items, by_chain[chain], seq0, prev)
            self._keep(chain, items, by_chain[chain], recs, rows, sealed)
            seq, prev = recs[-1].seq, recs[-1].hash
            if head is None:
                conn.execute(_HEAD_NEW, {"chain": chain, "seq": seq, "hash": prev})
            else:
                moved = conn.execute(_HEAD_MOVE, {"c": chain, "seq0": seq0, "seq1": seq, "hash1": prev})
                # The guarded update can only miss if another writer moved the head under us, which
                # the lock and the isolation level exclude.
                assert moved.rowcount == 1, f"audit head of chain {chain!r} moved during append"
        if postgres:
            conn.execute(_SEQSCAN_DEFAULT)
        if self._driver is not None:
            self._driver[1].executemany(conn.connection.driver_connection, rows)
        else:
            conn.execute(_LOG_ADD, rows)
        return [r for r in sealed if r is not None]

    def _keep(
        self,
        chain: str,
        items: Sequence[tuple[AuditEvent, int, str | None]],
        indices: list[int],
        recs: list[AuditRecord],
        rows: list[dict[str, object]],
        sealed: list[AuditRecord | None],
    ) -> None:
        """Take a chain's sealed records into the append (rows to insert, results) and remember its head."""
        for i, rec in zip(indices, recs, strict=True):
            rows.append(row_from_record(rec, chain=chain, source_hash=items[i][2]))
            sealed[i] = rec
        if self.remember_heads:
            self._heads[chain] = (recs[-1].seq, recs[-1].hash)

    def chains(self) -> list[str]:
        """Every chain that has a head or a record, sorted."""
        with self._engine.connect() as conn:
            named = set(conn.scalars(select(_HEAD.c.chain)))
            named |= set(conn.scalars(select(_LOG.c.chain).distinct()))
        return sorted(named)

    def iter_records(self, *, chain: str | None = None, batch: int = 1000) -> Iterator[AuditRecord]:
        """Every record of `chain` in seq order (None: every chain, chain by chain), read in pages."""
        for name in self.chains() if chain is None else [chain]:
            after = 0
            while True:
                with self._engine.connect() as conn:
                    rows = list(
                        conn.execute(
                            select(_LOG)
                            .where(_LOG.c.chain == name, _LOG.c.seq > after)
                            .order_by(_LOG.c.seq)
                            .limit(batch)
                        )
                    )
                if not rows:
                    break
                for row in rows:
                    yield record_from_row(row)
                after = rows[-1].seq

    def snapshot(self) -> tuple[dict[str, tuple[int, str]], dict[str, list[AuditRecord]]]:
        """Every chain's head and records, read in one transaction (a consistent snapshot: SQLite's
        WAL read transaction, REPEATABLE READ on PostgreSQL), so that appends during the read cannot
        look like records past their head."""
        conn = self._engine.connect()
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn:
            heads = {r.chain: (r.seq, r.hash) for r in conn.execute(select(_HEAD))}
            records: dict[str, list[AuditRecord]] = {c: [] for c in heads}
            for row in conn.execute(select(_LOG).order_by(_LOG.c.chain, _LOG.c.seq)):
                records.setdefault(row.chain, []).append(record_from_row(row))
        return heads, records

    def mirrored(self) -> dict[str, AuditRecord]:
        """Every record mirrored from a store record, by that store record's hash (`source_hash`)."""
        with self._engine.connect() as conn:
            rows = conn.execute(select(_LOG).where(_LOG.c.source_hash.is_not(None)))
            return {row.source_hash: record_from_row(row) for row in rows}

    def heads(self) -> dict[str, tuple[int, str]]:
        """Every chain's head: chain -> (seq, hash)."""
        with self._engine.connect() as conn:
            return {r.chain: (r.seq, r.hash) for r in conn.execute(select(_HEAD))}

    def chain_head(self, chain: str) -> tuple[int, str]:
        """(seq, hash) of the chain's newest record, (0, GENESIS_HASH) for a chain without records."""
        return self.heads().get(chain, (0, GENESIS_HASH))

    def head(self) -> tuple[int, str]:
        """Every chain at once: (the sum of the heads' seqs, which is the number of records the heads
        account for, and `heads_digest` of them)."""
        heads = self.heads()
        return sum(seq for seq, _ in heads.values()), heads_digest(heads)

    def verify_chains(self) -> list[ChainVerdict]:
        """Walk every chain against its head; one verdict per chain, in chain order."""
        heads = self.heads()
        out: list[ChainVerdict] = []
        for chain in self.chains():
            head = heads.get(chain, (0, GENESIS_HASH))
            result = verify_chain(self.iter_records(chain=chain), head=head)
            out.append(ChainVerdict(chain=chain, head_seq=head[0], head_hash=head[1], result=result))
        return out

    def verify(self) -> VerifyResult:
        """Every chain: ok when all are; `records` counts them all; a break is the first broken
        chain's (`verify_chains` names it)."""
        verdicts = self.verify_chains()
        total = sum(v.result.records for v in verdicts)
        for v in verdicts:
            if not v.result.ok:
                return VerifyResult(
                    ok=False, records=total, first_break_seq=v.result.first_break_seq, reason=v.result.reason
                )
        return VerifyResult(ok=True, records=total)

    def query_chained(
        self,
        *,
        tenant: str | None = None,
        chain: str | None = None,
        action: AuditAction | str | None = None,
        since_us: int | None = None,
        until_us: int | None = None,
        after_seq: int = 0,
        limit: int = 100,
    ) -> list[tuple[str, AuditRecord]]:
        """(chain, record) of records matching every given filter, in (ts_us, chain, seq) order, at
        most `limit`; `after_seq` keeps records with seq > after_seq in their chain."""
        if limit <= 0:
            raise ValueError(f"limit={limit} must be positive")
        stmt = select(_LOG).where(_LOG.c.seq > after_seq)
        if tenant is not None:
            stmt = stmt.where(_LOG.c.tenant == tenant)
        if chain is not None:
            stmt = stmt.where(_LOG.c.chain == chain)
        if action is not None:
            stmt = stmt.where(_LOG.c.action == str(AuditAction(action)))
        if since_us is not None:
            stmt = stmt.where(_LOG.c.ts_us >= since_us)
        if until_us is not None:
            stmt = stmt.where(_LOG.c.ts_us < until_us)
        stmt = stmt.order_by(_LOG.c.ts_us, _LOG.c.chain, _LOG.c.seq).limit(limit)
        with self._engine.connect() as conn:
            return [(row.chain, record_from_row(row)) for row in conn.execute(stmt)]

    def query(self, **filters: object) -> list[AuditRecord]:
        """The records of `query_chained` (same filters), without their chains."""
        return [rec for _, rec in self.query_chained(**filters)]  # type: ignore[arg-type]
