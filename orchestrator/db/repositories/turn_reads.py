"""A turn's registry reads on SQLite through the driver, in one snapshot: the session's facts, its
history, the tenant's effective policy, the session's segment spans and, for a switch or a new session,
the mappers to the turn's model, as `SessionRepository.facts` / `history`, `PolicyRepository.effective`,
`SegmentRepository.spans_of` and `MapperRepository.list` give them in a Session (their tested twins),
with the same statements (`DriverSelect`: same SQL text and type processing).

Why: every turn reads these before it plans; through a Session they cost a Session, a pool checkout with
a BEGIN statement, four Core executions and a ROLLBACK, several times the driver calls.

How: one SELECT (`_ONE`) that returns one row: the session's facts and its tenant's policy as columns,
the history's ids concatenated in SQL, with the turns' indexes aggregated beside them (the order check
below), and the spans as a JSON array. One statement on an autocommit connection reads one snapshot.
Why one row: Python 3.11's sqlite3 lets go of the GIL around each statement step and each
column of each fetched row, and the four statements' rows (a turn row per turn of the history, a span
row per segment) made about 70 such hand-overs a turn at 12 turns of history, growing with it; with 64
sessions' threads waiting for the GIL, each one hands it to another thread and waits to get it back
(orchestrator/README.md, "Session 39", measured with `perf` on the scheduler switches).

SQLite (3.40 here) promises no order for `group_concat` before 3.44's ORDER BY inside aggregates, so the
indexes are aggregated in the same pass as the ids and checked to be increasing: in that case the
concatenation is the history in turn order. The ids are blobs, which `||` and `group_concat` join byte
for byte as text in a UTF-8 database (the registry's encoding is checked once; in another one they would
be transcoded) and `CAST(... AS BLOB)` gives back; the result must also be 4 bytes a token of the
session's `history_tokens`. Where a check fails, and when the turn reads mapper rows (a new session or a
model switch: rare), the reads run as before, four statements between one BEGIN and its ROLLBACK on
one pooled connection (`_read_in_transaction`), so they see one snapshot, as in the Session.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, LargeBinary, bindparam, cast, func, literal, select, true
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.db.models import Policy, TurnStatus, blob_to_tokens
from orchestrator.db.repositories import mappers, policies, segments, sessions
from orchestrator.db.repositories.driver_select import DriverSelect
from orchestrator.db.repositories.policies import EffectivePolicy, effective_policy

__all__ = ["TurnReads", "TurnSnapshot", "reads_mappers"]

_P, _T = Policy.__table__, sessions._TURNS
# The history's DONE turns in index order: each turn's ids (input then output), and its index.
_HISTORY_ROWS = (
    select(
        _T.c.index.label("i"),
        _T.c.input_tokens.concat(_T.c.output_tokens).label("h"),
    )
    .where(_T.c.session_id == bindparam("sid"), _T.c.status == TurnStatus.DONE)
    .order_by(_T.c.index)
    .subquery("history_rows")
)
# One row, always: both aggregates in one pass over the same rows, so they meet them in the same order.
_HISTORY_AGG = select(
    cast(func.group_concat(_HISTORY_ROWS.c.h, literal("")), LargeBinary).label("history_ids"),
    func.group_concat(_HISTORY_ROWS.c.i).label("history_order"),
).subquery("history_agg")
_SPAN_ROWS = segments._SPANS.subquery("span_rows")
_SPANS_AGG = select(
    func.json_group_array(
        func.json_array(
            *(_SPAN_ROWS.c[k] for k in ("fingerprint", "model", "numerics", "start_pos", "end_pos"))
        )
    ).label("spans_json")
).subquery("spans_agg")
_FACT_COLUMNS = len(sessions._FACTS.selected_columns)
_ONE = (
    select(
        *sessions._FACTS.selected_columns,
        _P.c.tenant_id.label("policy_tenant_id"),
        *policies._EFFECTIVE.selected_columns,
        _HISTORY_AGG.c.history_ids,
        _HISTORY_AGG.c.history_order,
        _SPANS_AGG.c.spans_json,
    )
    .select_from(
        sessions._SESSIONS.outerjoin(_P, _P.c.tenant_id == sessions._SESSIONS.c.tenant_id)
        .join(_HISTORY_AGG, true())
        .join(_SPANS_AGG, true())
    )
    .where(sessions._SESSIONS.c.id == bindparam("sid"))
)


@dataclass(frozen=True, kw_only=True)
class TurnSnapshot:
    """What a turn read of the registry in one snapshot (`row` None: no such session of the tenant;
    the rest is then empty).

    `history_ids` are the history's ids as the turn rows store them (u32 little-endian, what
    `storage.token_bytes(history)` gives): the store and the digests take the ids in that form, and a
    64K-token history costs about 0.4 ms to encode again.

    `mappers` holds every mapper row to the turn's model (`MapperRepository.list(receiver_model=...)`
    as Core rows), read only when the turn reads mapper rows: a switch of the session to another model
    or a session without history (`reads_mappers`); None otherwise.
    """

    row: Any | None
    history: list[int] = field(default_factory=list)
    history_ids: bytes = b""
    policy: EffectivePolicy | None = None
    spans: list[Any] = field(default_factory=list)
    mappers: list[Any] | None = None


@dataclass(frozen=True, slots=True)
class _Ask:
    """What `TurnReads.read` was asked."""

    session_id: str
    tenant_id: str
    default_floor_s: float
    default_ceiling_s: float
    model: str | None


def reads_mappers(row: Any, history: list[int], model: str) -> bool:
    """Whether a turn of `model` on this session reads mapper rows: a switch from the model of its last
    turn, or no history yet (its prompt may be stored under another model)."""
    last = row.model if row.turn_count else None
    return (last is not None and last != model) or not history


class TurnReads:
    """The per-turn reads on SQLite through the driver (`_ONE`, else the four statements in one read
    transaction); `read` returns None on other databases (the caller reads through a Session).

    Args:
        sessions: the registry's read sessions (their engine is used when it is SQLite).
        driver: read through the driver on SQLite (default True; False: `read` always returns None).
        one_statement: read with `_ONE` where it serves (default True); False: always the four statements
            in a transaction (its twin in the tests, the baseline of `benchmarks.bench_turn_reads`).
    """

    def __init__(
        self, sessions_: sessionmaker[Session], *, driver: bool = True, one_statement: bool = True
    ) -> None:
        self._one_statement = one_statement
        self._utf8: bool | None = None  # the registry's encoding, read once
        bind = getattr(sessions_, "kw", {}).get("bind")
        self._engine: Engine | None = (
            bind if driver and isinstance(bind, Engine) and bind.dialect.name == "sqlite" else None
        )
        if self._engine is not None:
            dialect = self._engine.dialect
            self._facts = DriverSelect(sessions._FACTS, dialect)
            self._history = DriverSelect(sessions._HISTORY, dialect)
            self._policy = DriverSelect(policies._EFFECTIVE, dialect)
            self._spans = DriverSelect(segments._SPANS, dialect)
            self._mappers = DriverSelect(mappers._OF_RECEIVER, dialect)
            self._one = DriverSelect(_ONE, dialect)

    def read(
        self,
        session_id: str,
        *,
        tenant_id: str,
        default_floor_s: float,
        default_ceiling_s: float,
        model: str | None = None,
    ) -> TurnSnapshot | None:
        """The snapshot of a turn of `model` (None: the session's model) on the session."""
        if self._engine is None:
            return None
        raw = self._engine.raw_connection()
        try:
            cursor = raw.cursor()
            try:
                ask = _Ask(session_id, tenant_id, default_floor_s, default_ceiling_s, model)
                got = self._read_one(cursor, ask) if self._one_statement else None
                return got if got is not None else self._read_in_transaction(cursor, ask)
            finally:
                cursor.close()
        finally:
            raw.close()

    def _read_one(self, cursor: Any, ask: _Ask) -> TurnSnapshot | None:
        """The snapshot from `_ONE`; None where the four statements must read it (`_read_in_transaction`):
        the registry is not UTF-8, the history's aggregate came out of turn order or not 4 bytes a token of
        the session's history, or the turn reads mapper rows."""
        if self._utf8 is None:
            ((encoding,),) = cursor.execute("PRAGMA encoding").fetchall()
            self._utf8 = encoding == "UTF-8"
        if not self._utf8:
            return None
        found = self._one.rows(cursor, {"sid": ask.session_id})
        if not found:
            return TurnSnapshot(row=None)
        one = found[0]
        row = self._facts.row_type._make(one[:_FACT_COLUMNS])
        # as SessionRepository.facts: another tenant's session reads as absent
        if row.tenant_id != ask.tenant_id:
            return TurnSnapshot(row=None)
        if one.history_order is not None and not _increasing(one.history_order):
            return None
        blob = one.history_ids or b""
        if len(blob) != 4 * row.history_tokens:
            return None
        history = blob_to_tokens(blob)
        if reads_mappers(row, history, ask.model or row.model):
            return None
        held = (
            self._policy.row_type._make(one[_FACT_COLUMNS + 1 : _FACT_COLUMNS + 4])
            if one.policy_tenant_id is not None
            else None
        )
        policy = effective_policy(
            row.tenant_id, held, default_floor_s=ask.default_floor_s, default_ceiling_s=ask.default_ceiling_s
        )
        make_span = self._spans.row_type._make
        # as `_SPANS`' ORDER BY start_pos (its ties in no promised order there either)
        spans = sorted(map(make_span, json.loads(one.spans_json)), key=operator.attrgetter("start_pos"))
        return TurnSnapshot(row=row, history=history, history_ids=blob, policy=policy, spans=spans)

    def _read_in_transaction(self, cursor: Any, ask: _Ask) -> TurnSnapshot:
        # A deferred read transaction (autocommit connections, `engine.py`): one snapshot for all four
        # reads, and no write lock taken.
        cursor.execute("BEGIN")
        try:
            return self._read(cursor, ask)
        finally:
            cursor.execute("ROLLBACK")

    def _read(self, cursor: Any, ask: _Ask) -> TurnSnapshot:
        found = self._facts.rows(cursor, {"sid": ask.session_id})
        row = found[0] if found else None
        # as SessionRepository.facts: another tenant's session reads as absent
        if row is None or row.tenant_id != ask.tenant_id:
            return TurnSnapshot(row=None)
        blob = b"".join(b for r in self._history.rows(cursor, {"sid": ask.session_id}) for b in r)
        held = self._policy.rows(cursor, {"tid": row.tenant_id})
        policy = effective_policy(
            row.tenant_id,
            held[0] if held else None,
            default_floor_s=ask.default_floor_s,
            default_ceiling_s=ask.default_ceiling_s,
        )
        spans = self._spans.rows(cursor, {"sid": ask.session_id})
        history = blob_to_tokens(blob)
        name = ask.model or row.model
        found = self._mappers.rows(cursor, {"rm": name}) if reads_mappers(row, history, name) else None
        return TurnSnapshot(
            row=row, history=history, history_ids=blob, policy=policy, spans=spans, mappers=found
        )


def _increasing(order: str) -> bool:
    """Whether the comma-separated turn indexes `order` (group_concat's) rise strictly."""
    ix = list(map(int, order.split(",")))
    return all(map(operator.lt, ix, ix[1:]))
