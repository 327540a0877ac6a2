"""A turn's one registry transaction (its "finish"), as a value and as the statements that write it.

`FinishRequest` holds everything the transaction writes, built by the turn engine before the transaction
begins: the session's guarded move, the finished turn row (inserted, or the reserved row closed), the
segment links of what the store holds durably, and the store's audit records of the turn's write. It
pickles, so that the registry writer process (orchestrator/registry_writer/) can run the same
transaction as the turn's own thread does (`write_finish`, in both).

Knows nothing of models, turns in flight or the store: the caller acknowledges the audit records to the
store after the commit, or hands them back when the transaction fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, insert, select, update

from orchestrator.api import PreconditionError
from orchestrator.db import DriverDML, DurableSegment, SegmentRepository, SqlAuditSink, forget_gone_chunks
from orchestrator.db.models import SessionRow, SessionStatus, TurnRow, TurnStatus
from storage import AuditRecord

__all__ = ["DriverFinish", "FinishRequest", "write_finish"]

_SESSIONS, _TURNS = SessionRow.__table__, TurnRow.__table__


class _FinishStatements:
    """The finish's Core statements, built once (every turn runs them; building one costs several times
    what running it from the compiled cache does)."""

    session = select(_SESSIONS.c.status, _SESSIONS.c.turn_count).where(
        _SESSIONS.c.id == bindparam("sid"), _SESSIONS.c.tenant_id == bindparam("tid")
    )
    # A reserved turn (PostgreSQL) was checked at its reservation: the session must still exist.
    advance = (
        update(_SESSIONS)
        .where(_SESSIONS.c.id == bindparam("sid"), _SESSIONS.c.tenant_id == bindparam("tid"))
        .values(
            turn_count=bindparam("next"),
            history_tokens=_SESSIONS.c.history_tokens + bindparam("grown"),
            model=bindparam("new_model"),
        )
    )
    # Without a reservation (SQLite): still open and still at this turn's index.
    advance_open_at = advance.where(
        _SESSIONS.c.status == bindparam("open"), _SESSIONS.c.turn_count == bindparam("at")
    )
    add_turn = insert(_TURNS)
    close_turn = update(_TURNS).where(
        _TURNS.c.id == bindparam("turn_id"), _TURNS.c.status == bindparam("running")
    )


_FINISH = _FinishStatements()


class DriverFinish:
    """The statements of a SQLite finish (no reservation) as driver statements: the guarded session move,
    and the turn insert compiled for each set of column keys it is given (one, in practice)."""

    def __init__(self, dialect: Any) -> None:
        self._dialect = dialect
        self.advance_open_at = DriverDML(_FINISH.advance_open_at, dialect)
        self._inserts: dict[frozenset[str], DriverDML] = {}

    def add_turn(self, values: dict[str, Any]) -> DriverDML:
        keys = frozenset(values)
        stmt = self._inserts.get(keys)
        if stmt is None:
            stmt = self._inserts[keys] = DriverDML(_FINISH.add_turn, self._dialect, keys=sorted(keys))
        return stmt


@dataclass(frozen=True)
class FinishRequest:
    """What one turn's finish writes (see the module doc).

    Attributes:
        advance: the session move's parameters (sid, tid, next, grown, new_model; with `open` and `at`
            when the turn holds no reservation).
        new_turn: the finished turn row to insert (None: `turn_id`'s reserved row is closed instead).
        turn_id: the reserved row (None: no reservation).
        done: the finished columns a reserved row is closed with.
        segments: the chunks the store wrote durably for this turn (None: nothing persisted).
        fingerprint: the served model's fingerprint (hex) the segments belong to.
        claimed: the store's audit records of this turn's write, mirrored into the tenant's chain.
        node: this node's name (whose segment rows the records' evictions remove).
    """

    session_id: str
    tenant_id: str
    advance: dict[str, Any]
    new_turn: dict[str, Any] | None
    turn_id: int | None
    done: dict[str, Any]
    segments: Sequence[DurableSegment] | None
    fingerprint: str
    claimed: Sequence[AuditRecord]
    node: str


def _why_not_advanced(conn: Any, req: FinishRequest) -> None:
    """Raise the reason the turn's guarded session update matched no row."""
    row = conn.execute(_FINISH.session, {"sid": req.session_id, "tid": req.tenant_id}).one_or_none()
    if row is None:
        raise PreconditionError(f"session {req.session_id} was deleted during its turn")
    if row.status != SessionStatus.OPEN:
        raise PreconditionError(f"session {req.session_id} is closed", reason="SESSION_CLOSED")
    raise PreconditionError(f"session {req.session_id} advanced to turn {row.turn_count} meanwhile")


def write_finish(
    conn: Any, s: Any, req: FinishRequest, audit: SqlAuditSink, driver: DriverFinish | None
) -> None:
    """The finish's statements inside an open write transaction: `conn` its Connection, `s` what the
    repositories take (the same Connection, or the ORM Session that owns it). `driver`: the SQLite
    driver statements for a finish without a reservation (None: Core statements).

    Raises:
        PreconditionError: the session was deleted, closed or advanced during the turn.
    """
    # The session moves on in one guarded statement (no read first); when it matches nothing, a read
    # says why (the rare path).
    if driver is not None and req.new_turn is not None:
        raw = conn.connection.driver_connection
        if driver.advance_open_at.execute(raw, req.advance) != 1:
            _why_not_advanced(conn, req)
        driver.add_turn(req.new_turn).execute(raw, req.new_turn)
    else:
        stmt = _FINISH.advance_open_at if req.turn_id is None else _FINISH.advance
        if conn.execute(stmt, req.advance).rowcount != 1:
            _why_not_advanced(conn, req)
        if req.new_turn is not None:
            conn.execute(_FINISH.add_turn, req.new_turn)
        else:
            done = conn.execute(
                _FINISH.close_turn, {"turn_id": req.turn_id, "running": TurnStatus.RUNNING, **req.done}
            )
            if done.rowcount != 1:
                raise PreconditionError(f"session {req.session_id} was deleted during its turn")
    dropped: list[bytes] = []
    if req.segments is not None:
        # Link the session to its current chunks and unlink the ones the store superseded (a shorter
        # tail), deleting rows no session links any more.
        dropped = SegmentRepository(s).link_current(req.session_id, req.fingerprint, req.segments)
    if req.claimed:
        audit.mirror_in(s, req.claimed)
        # An eviction this put made names chunks other rows point at: they go with it. The superseded
        # tail's rows the links just deleted are not looked for again.
        forget_gone_chunks(s, node=req.node, records=req.claimed, deleted=dropped)
