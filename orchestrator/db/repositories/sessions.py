"""Sessions of a tenant: create, read (tenant-scoped), list, close, fork at a turn, delete."""

from __future__ import annotations

import datetime as dt
import uuid

from sqlalchemy import bindparam, func, select, tuple_
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session

from orchestrator.db.models import (
    CacheSegment,
    SessionRow,
    SessionSegment,
    SessionStatus,
    TurnRow,
    TurnStatus,
    blob_to_tokens,
)
from orchestrator.db.repositories.read_connection import read_connection

__all__ = ["SessionRepository"]

_SESSIONS, _TURNS = SessionRow.__table__, TurnRow.__table__
# The per-turn reads, built once (building a statement costs several times what running a cached one does).
_FACTS = select(
    _SESSIONS.c.id,
    _SESSIONS.c.tenant_id,
    _SESSIONS.c.status,
    _SESSIONS.c.model,
    _SESSIONS.c.turn_count,
    _SESSIONS.c.history_tokens,
    _SESSIONS.c.retention_s,
).where(_SESSIONS.c.id == bindparam("sid"))
_HISTORY = (
    select(_TURNS.c.input_tokens, _TURNS.c.output_tokens)
    .where(_TURNS.c.session_id == bindparam("sid"), _TURNS.c.status == TurnStatus.DONE)
    .order_by(_TURNS.c.index)
)
_HISTORY_UPTO = _HISTORY.where(_TURNS.c.index < bindparam("upto"))


class SessionRepository:
    """Every read takes the caller's tenant: a session of another tenant reads as absent (None)."""

    def __init__(self, session: Session) -> None:
        self._s = session

    def create(
        self,
        *,
        tenant_id: str,
        model: str,
        retention_s: float,
        retention_hint_s: float | None = None,
        node: str = "",
        region: str = "",
        session_id: str | None = None,
    ) -> SessionRow:
        if not model:
            raise ValueError("model must be non-empty")
        row = SessionRow(
            id=session_id or uuid.uuid4().hex,
            tenant_id=tenant_id,
            model=model,
            status=SessionStatus.OPEN,
            retention_s=retention_s,
            retention_hint_s=retention_hint_s,
            node=node,
            region=region,
            history_tokens=0,
            turn_count=0,
        )
        self._s.add(row)
        self._s.flush()
        return row

    def get(self, session_id: str, *, tenant_id: str | None) -> SessionRow | None:
        """The session, or None when absent or owned by another tenant (`tenant_id=None`: admin, any)."""
        row = self._s.get(SessionRow, session_id)
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            return None
        return row

    def facts(self, session_id: str, *, tenant_id: str | None) -> Row | None:
        """The session's columns a turn reads (id, tenant_id, status, model, turn_count, history_tokens,
        retention_s) as a Core row, without loading an ORM object; None as `get` gives None."""
        row = read_connection(self._s).execute(_FACTS, {"sid": session_id}).one_or_none()
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            return None
        return row

    def get_for_update(self, session_id: str, *, tenant_id: str | None) -> SessionRow | None:
        """Like `get`, but locks the row (PostgreSQL `FOR UPDATE`) so concurrent turns serialise."""
        stmt = select(SessionRow).where(SessionRow.id == session_id).with_for_update()
        row = self._s.scalars(stmt).one_or_none()
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            return None
        return row

    def list(
        self,
        *,
        tenant_id: str,
        limit: int,
        after: tuple[dt.datetime, str] | None = None,
        include_closed: bool = True,
    ) -> list[SessionRow]:
        """Sessions of the tenant ordered by (created_at, id), strictly after `after` = (created_at, id).

        The cursor is a position, not a row, so paging continues correctly when that session was deleted.
        """
        if limit <= 0:
            raise ValueError(f"limit={limit} must be positive")
        stmt = select(SessionRow).where(SessionRow.tenant_id == tenant_id)
        if not include_closed:
            stmt = stmt.where(SessionRow.status == SessionStatus.OPEN)
        if after is not None:
            stmt = stmt.where(tuple_(SessionRow.created_at, SessionRow.id) > tuple_(*after))
        stmt = stmt.order_by(SessionRow.created_at, SessionRow.id).limit(limit)
        return list(self._s.scalars(stmt))

    def count(self, *, tenant_id: str) -> int:
        return self._s.scalar(select(func.count()).where(SessionRow.tenant_id == tenant_id)) or 0

    def close(self, row: SessionRow) -> None:
        row.status = SessionStatus.CLOSED
        self._s.flush()

    def history(self, session_id: str, *, upto_turn: int | None = None) -> list[int]:
        """The session's token history (inputs then outputs of each finished turn, in order).

        Args:
            upto_turn: include turns with index < upto_turn only (None: all).
        """
        return blob_to_tokens(self.history_blob(session_id, upto_turn=upto_turn))

    def history_blob(self, session_id: str, *, upto_turn: int | None = None) -> bytes:
        """`history` as the turn rows store it: the ids as u32 little-endian bytes (`tokens_to_blob`)."""
        params: dict[str, object] = {"sid": session_id}
        stmt = _HISTORY
        if upto_turn is not None:
            stmt = _HISTORY_UPTO
            params["upto"] = upto_turn
        # Core rows of the two blobs: every turn reads its session's history, and ORM objects of every
        # turn row cost many times the read itself.
        return b"".join(b for row in read_connection(self._s).execute(stmt, params) for b in row)

    def fork(self, parent: SessionRow, *, at_turn: int, session_id: str | None = None) -> SessionRow:
        """A new session of the same tenant and model whose history is the parent's turns [0, at_turn).

        Finished turns are copied (the fork owns its rows and survives the parent's deletion); the
        parent's cache segments that lie inside the forked prefix are linked to the fork too, so the
        shared chunks live while either session needs them.

        Raises:
            ValueError: `at_turn` outside [0, parent.turn_count].
        """
        if not 0 <= at_turn <= parent.turn_count:
            raise ValueError(f"at_turn={at_turn} outside [0, {parent.turn_count}] for session {parent.id}")
        child = self.create(
            tenant_id=parent.tenant_id,
            model=parent.model,
            retention_s=parent.retention_s,
            retention_hint_s=parent.retention_hint_s,
            node=parent.node,
            region=parent.region,
            session_id=session_id,
        )
        child.parent_session_id = parent.id
        child.forked_at_turn = at_turn
        history = 0
        copied = 0
        stmt = (
            select(TurnRow)
            .where(
                TurnRow.session_id == parent.id, TurnRow.index < at_turn, TurnRow.status == TurnStatus.DONE
            )
            .order_by(TurnRow.index)
        )
        for turn in self._s.scalars(stmt):
            self._s.add(
                TurnRow(
                    session_id=child.id,
                    index=copied,
                    model=turn.model,
                    status=turn.status,
                    path=turn.path,
                    reason=turn.reason,
                    input_tokens=turn.input_tokens,
                    output_tokens=turn.output_tokens,
                    cached=turn.cached,
                    replayed_encoder=turn.replayed_encoder,
                    replayed_decoder=turn.replayed_decoder,
                    prefilled=turn.prefilled,
                    mapped=turn.mapped,
                    ttft_s=turn.ttft_s,
                    decode_tokens_per_s=turn.decode_tokens_per_s,
                    total_s=turn.total_s,
                    persisted=turn.persisted,
                    created_at=turn.created_at,
                )
            )
            copied += 1
            history += (len(turn.input_tokens) + len(turn.output_tokens)) // 4
            child.model = turn.model
        child.turn_count = copied
        child.history_tokens = history
        shared = (
            select(SessionSegment.segment_id)
            .join(CacheSegment)
            .where(SessionSegment.session_id == parent.id, CacheSegment.end_pos <= history)
        )
        for segment_id in self._s.scalars(shared):
            self._s.add(SessionSegment(session_id=child.id, segment_id=segment_id))
        self._s.flush()
        return child

    def delete(self, row: SessionRow) -> None:
        """Delete the session row; turns and segment links cascade (segments are purged by the caller)."""
        self._s.delete(row)
        self._s.flush()
