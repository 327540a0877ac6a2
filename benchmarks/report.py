"""The one JSON option every benchmark takes: `--json [PATH|-]` (a file, or stdout with the table on
stderr). The option and the writing are the `kvresume` command line's own (orchestrator/cli/output.py),
so benchmarks and commands behave alike; this module adds what only benchmark entry points do."""

from __future__ import annotations

import sys

import structlog

from orchestrator.cli.output import add_json_flag, table_stream, write_json

__all__ = ["add_json_flag", "logs_to_stderr", "table_stream", "write_json"]


def logs_to_stderr() -> None:
    """Send the service's log lines to stderr (structlog's default is stdout), so `--json -` stays JSON.
    For benchmark entry points only: configuring logging is the entry point's job."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
