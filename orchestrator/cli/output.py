"""Where a command's result goes: `--json [PATH|-]` (machine-readable, the same option every benchmark
takes) and the human-readable text beside it. Knows nothing of what the commands compute.

The rule, for every `kvresume` command and `python -m benchmarks.<name>`:

- no `--json`: text on stdout;
- `--json` or `--json -`: the JSON document on stdout, the text on stderr (so a pipe reads JSON only);
- `--json PATH`: the JSON document written to PATH, the text on stdout.

Warnings and errors always go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = [
    "add_json_flag",
    "fields_text",
    "json_lines",
    "table_text",
    "table_stream",
    "text_stream",
    "write_json",
]

STDOUT = "-"


def add_json_flag(parser: argparse.ArgumentParser, *, what: str = "the result") -> None:
    """`--json [PATH|-]`: bare `--json` means stdout. Put it after positional arguments (or write
    `--json -`): `--json NAME` would take NAME as the file to write."""
    parser.add_argument(
        "--json",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="PATH|-",
        help=f"write {what} as JSON to PATH, or to stdout with a bare --json or '-' (the text then goes "
        "to stderr)",
    )


def text_stream(dest: str | None) -> TextIO:
    """Where the human-readable text goes: stderr when the JSON takes stdout, else stdout."""
    return sys.stderr if dest == STDOUT else sys.stdout


# The benchmarks' name for it (their text is a table).
table_stream = text_stream


def write_json(doc: Any, dest: str | None) -> None:
    """Write `doc` as one JSON document to `dest` (None: nowhere, "-": stdout, else a file path).

    Raises:
        OSError: the file cannot be written.
    """
    if dest is None:
        return
    text = json.dumps(doc, indent=1)
    if dest == STDOUT:
        print(text, flush=True)
    else:
        with open(dest, "w") as fh:
            fh.write(text + "\n")


@contextmanager
def json_lines(dest: str | None) -> Iterator[Any]:
    """A writer of one compact JSON object per line (a stream of events) to `dest`, flushed per line;
    with `dest` None, a writer that drops everything.

    Raises:
        OSError: the file cannot be opened.
    """
    if dest is None:
        yield lambda doc: None
        return
    fh = sys.stdout if dest == STDOUT else open(dest, "w")

    def write(doc: Any) -> None:
        fh.write(json.dumps(doc, sort_keys=True) + "\n")
        fh.flush()

    try:
        yield write
    finally:
        if fh is not sys.stdout:
            fh.close()


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(_scalar(v) for v in value) if value else "-"
    if value in ("", None):
        return "-"
    return str(value)


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key in sorted(doc):
        value = doc[key]
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def fields_text(doc: Mapping[str, Any]) -> str:
    """One `key: value` line per field, nested fields as dotted keys, sorted."""
    rows = list(_flatten(doc))
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k + ':':<{width + 1}} {_scalar(v)}" for k, v in rows)


def table_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A left-aligned table: `columns` are (header, key) pairs, a dotted key reads a nested field."""

    def cell(row: Mapping[str, Any], key: str) -> str:
        value: Any = row
        for part in key.split("."):
            value = value.get(part, "") if isinstance(value, Mapping) else ""
        return _scalar(value)

    cells = [[cell(r, key) for _, key in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)
