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

from orchestrator.db.repositories.driver_binds import DriverBinds, compile_for_driver

__all__ = ["DriverSelect"]


class DriverSelect:
    """`stmt` for `dialect` (SQLite): `rows(cursor_owner, params)` gives what `Connection.execute(stmt,
    params).all()` gives, as named tuples with the statement's column keys.

    Raises:
        ValueError: the statement has an expanding or post-compile parameter.
    """

    def __init__(self, stmt: Select[Any], dialect: Dialect) -> None:
        compiled = compile_for_driver(stmt, dialect, "DriverSelect")
        self.sql = compiled.string
        self._params = DriverBinds(compiled, dialect).params
        columns = list(stmt.selected_columns)
        self._row = namedtuple("Row", [c.key for c in columns], rename=True)  # type: ignore[misc]
        self._results = [c.type.dialect_impl(dialect).result_processor(dialect, None) for c in columns]
        # no column converts (ids, counts, blobs: a history's rows): rows go to the tuple as they are
        self._plain = all(p is None for p in self._results)

    @property
    def row_type(self) -> Any:
        """The named tuple `rows` gives (its fields are the statement's column keys)."""
        return self._row

    def rows(self, raw: Any, params: Mapping[str, Any]) -> list[Any]:
        """Run on `raw` (a DBAPI connection or cursor: anything with `execute(sql, params)`)."""
        procs = self._results
        make = self._row._make
        found = raw.execute(self.sql, self._params(params)).fetchall()
        if self._plain:
            return list(map(make, found))
        return [make(p(v) if p is not None else v for p, v in zip(procs, row, strict=True)) for row in found]
