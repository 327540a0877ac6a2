"""The parameters of a Core statement compiled once for SQLite, as the driver takes them: the bind names
in the compiled statement's order, each value through the bind processor SQLAlchemy applies, a column's
Python-side default (`default=` on insert, `onupdate=` on update) computed per row where no value is given.
Shared by `DriverSelect` and `DriverDML`; knows nothing about running the statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Dialect
from sqlalchemy.sql.compiler import SQLCompiler

__all__ = ["DriverBinds", "compile_for_driver"]


def compile_for_driver(
    stmt: Any, dialect: Dialect, what: str, column_keys: list[str] | None = None
) -> SQLCompiler:
    """`stmt` compiled for `dialect`; `what` names the caller in the error.

    Raises:
        ValueError: the statement has an expanding (IN-list) or post-compile parameter.
    """
    compiled = stmt.compile(dialect=dialect, column_keys=column_keys)
    if "POSTCOMPILE" in compiled.string or any(b.expanding for b in compiled.binds.values()):
        raise ValueError(f"{what} takes no expanding (IN-list) parameters")
    return compiled


class DriverBinds:
    """`params(values)`: the positional parameter list of `compiled` for the values keyed by bind name.

    A name absent from `values` takes its column's default when `defaults` names one, else raises
    KeyError when the bind is required, else keeps the value bound in the statement.
    """

    def __init__(
        self, compiled: SQLCompiler, dialect: Dialect, defaults: Mapping[str, Any] | None = None
    ) -> None:
        defaults = defaults or {}
        self._binds: list[tuple[str, Any, bool, Any, Any]] = []
        for name in compiled.positiontup or []:
            bind = compiled.binds[name]
            proc = bind.type.dialect_impl(dialect).bind_processor(dialect)
            self._binds.append((name, bind.value, bind.required, proc, defaults.get(name)))

    def params(self, values: Mapping[str, Any]) -> list[Any]:
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
