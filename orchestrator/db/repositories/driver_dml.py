"""A Core INSERT or UPDATE compiled once for SQLite (for one set of parameter keys) and run on the
transaction's sqlite3 connection: the SQL text SQLAlchemy sends, each value through the bind processor
SQLAlchemy applies, and the columns' Python-side defaults (`default=` on insert, `onupdate=` on update)
computed per row as SQLAlchemy computes them, without its per-execution machinery.

Why: a turn's write transaction, which every other turn waits for, runs a few such statements, and
SQLAlchemy's execution of each (cache key, execution context, parameter processing, result setup, events)
costs several times the driver call. Only statements without expanding or post-compile parameters and
without RETURNING; `DriverDML` refuses the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.sql.dml import ValuesBase

from orchestrator.db.repositories.driver_binds import DriverBinds, compile_for_driver

__all__ = ["DriverDML"]


class DriverDML:
    """`stmt` for `dialect` (SQLite) with the parameter keys `keys` (None: the statement's own binds).

    `execute(raw, values)` is `Connection.execute(stmt, values)` and returns its rowcount;
    `executemany(raw, rows)` is `Connection.execute(stmt, rows)`.

    Raises:
        ValueError: an expanding or post-compile parameter, or a RETURNING clause.
    """

    def __init__(self, stmt: ValuesBase | Any, dialect: Dialect, keys: Sequence[str] | None = None) -> None:
        compiled = compile_for_driver(stmt, dialect, "DriverDML", list(keys) if keys is not None else None)
        if compiled.returning:
            raise ValueError("DriverDML takes no RETURNING statement")
        self.sql = compiled.string
        self.keys = frozenset(keys) if keys is not None else None
        defaults = {c.key: c.default for c in compiled.insert_prefetch}
        defaults.update({c.key: c.onupdate for c in compiled.update_prefetch})
        self._params = DriverBinds(compiled, dialect, defaults).params

    def execute(self, raw: Any, values: Mapping[str, Any]) -> int:
        """Run once on `raw` (a sqlite3 connection); the number of rows it matched."""
        return raw.execute(self.sql, self._params(values)).rowcount

    def executemany(self, raw: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        raw.executemany(self.sql, [self._params(r) for r in rows])
