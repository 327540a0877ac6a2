"""The connection a repository runs a Core read on inside the caller's Session.

`Session.execute` of a Core statement goes through the ORM's execution path (compile state, ORM events,
autoflush) even when it loads no object; the per-turn reads return Core rows, so they run on the Session's
own connection (same transaction) and skip that path, flushing first as `Session.execute` would.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

__all__ = ["read_connection"]


def read_connection(session: Session) -> Connection:
    """`session`'s connection in its current transaction (begun if none), after the autoflush
    `session.execute` would run, so a read sees the session's pending ORM changes as it would there."""
    # what Session.execute's autoflush runs (flush returns at once when nothing is pending)
    if session.autoflush and not session._flushing:  # noqa: SLF001 - the flag autoflush itself checks
        session.flush()
    return session.connection()
