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

__all__ = ["DriverDML"]


class DriverDML:
    """`stmt` for `dialect` (SQLite) with the parameter keys `keys` (None: the statement's own binds).

    `execute(raw, values)` is `Connection.execute(stmt, values)` and returns its rowcount;
    `executemany(raw, rows)` is `Connection.execute(stmt, rows)`.

    Raises:
        ValueError: an expanding or post-compile parameter, or a RETURNING clause.
    """

    def __init__(self, stmt: ValuesBase | Any, dialect: Dialect, keys: Sequence[str] | None = None) -> None:
        compiled = stmt.compile(dialect=dialect, column_keys=list(keys) if keys is not None else None)
        if "POSTCOMPILE" in compiled.string or any(b.expanding for b in compiled.binds.values()):
            raise ValueError("DriverDML takes no expanding (IN-list) parameters")
        if compiled.returning:
            raise ValueError("DriverDML takes no RETURNING statement")
        self.sql = compiled.string
        self.keys = frozenset(keys) if keys is not None else None
        defaults = {c.key: c.default for c in compiled.insert_prefetch}
        defaults.update({c.key: c.onupdate for c in compiled.update_prefetch})
        self._binds: list[tuple[str, Any, bool, Any, Any]] = []
        for name in compiled.positiontup or []:
            bind = compiled.binds[name]
            proc = bind.type.dialect_impl(dialect).bind_processor(dialect)
            self._binds.append((name, bind.value, bind.required, proc, defaults.get(name)))

    def _params(self, values: Mapping[str, Any]) -> list[Any]:
        out = []
        for name, fixed, required, proc, default in self._binds:
            if name in values:
                value = values[name]
            elif default is not None:
                # SQLAlchemy wraps a column default's callable to take the execution context (unused here)
                value = default.arg(None) if default.is_callable else default.arg
            elif required:
                raise KeyError(f"parameter {name!r} is required")
            else:
                value = fixed
            out.append(proc(value) if proc is not None and value is not None else value)
        return out

    def execute(self, raw: Any, values: Mapping[str, Any]) -> int:
        """Run once on `raw` (a sqlite3 connection); the number of rows it matched."""
        return raw.execute(self.sql, self._params(values)).rowcount

    def executemany(self, raw: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        raw.executemany(self.sql, [self._params(r) for r in rows])
