"""The one JSON option every benchmark takes: `--json PATH|-` (a file, or stdout with the table on stderr)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import structlog

__all__ = ["add_json_flag", "logs_to_stderr", "table_stream", "write_json"]


def logs_to_stderr() -> None:
    """Send the service's log lines to stderr (structlog's default is stdout), so `--json -` stays JSON.
    For benchmark entry points only: configuring logging is the entry point's job."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH|-",
                        help="write the JSON document to PATH, or '-' for stdout (the table then goes to "
                        "stderr)")


def table_stream(dest: str | None) -> TextIO:
    """Where the human-readable table goes: stderr when the JSON takes stdout."""
    return sys.stderr if dest == "-" else sys.stdout


def write_json(doc: Any, dest: str | None) -> None:
    """Write `doc` to `dest` (None: nowhere, "-": stdout)."""
    if dest is None:
        return
    text = json.dumps(doc, indent=1)
    if dest == "-":
        print(text, flush=True)
    else:
        with open(dest, "w") as fh:
            fh.write(text + "\n")
