"""A Core SELECT compiled once for SQLite and run on a sqlite3 connection: the SQL text SQLAlchemy sends,
its bound values through the same bind processors and its columns through the same result processors,
without SQLAlchemy's per-execution machinery (compiled-cache lookup, execution context, result setup,
events), which costs several times the driver call for the small per-turn reads.

Only for statements without expanding (IN-list) or post-compile parameters; `DriverSelect` refuses them.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Select
from sqlalchemy.engine import Dialect

__all__ = ["DriverSelect"]


class DriverSelect:
    """`stmt` for `dialect` (SQLite): `rows(cursor_owner, params)` gives what `Connection.execute(stmt,
    params).all()` gives, as named tuples with the statement's column keys.

    Raises:
        ValueError: the statement has an expanding or post-compile parameter.
    """

    def __init__(self, stmt: Select[Any], dialect: Dialect) -> None:
        compiled = stmt.compile(dialect=dialect)
        if "POSTCOMPILE" in compiled.string or any(b.expanding for b in compiled.binds.values()):
            raise ValueError("DriverSelect takes no expanding (IN-list) parameters")
        self.sql = compiled.string
        names = compiled.positiontup or []
        self._binds = []
        for name in names:
            bind = compiled.binds[name]
            proc = bind.type.dialect_impl(dialect).bind_processor(dialect)
            self._binds.append((name, bind.value if not bind.required else None, bind.required, proc))
        columns = list(stmt.selected_columns)
        self._row = namedtuple("Row", [c.key for c in columns], rename=True)  # type: ignore[misc]
        self._results = [c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns]

    def _params(self, params: Mapping[str, Any]) -> list[Any]:
        out = []
        for name, fixed, required, proc in self._binds:
            if name in params:
                value = params[name]
            elif required:
                raise KeyError(f"parameter {name!r} is required")
            else:
                value = fixed
            out.append(proc(value) if proc is not None and value is not None else value)
        return out

    def rows(self, raw: Any, params: Mapping[str, Any]) -> list[Any]:
        """Run on `raw` (a DBAPI connection or cursor: anything with `execute(sql, params)`)."""
        procs = self._results
        make = self._row._make
        return [
            make(p(v) if p is not None else v for p, v in zip(procs, row, strict=True))
            for row in raw.execute(self.sql, self._params(params)).fetchall()
        ]
