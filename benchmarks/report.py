"""The one JSON option every benchmark takes: `--json [PATH|-]` (a file, or stdout with the table on
stderr). The option and the writing are the `kvresume` command line's own (orchestrator/cli/output.py),
so benchmarks and commands behave alike; this module adds what only benchmark entry points do."""

from __future__ import annotations

from orchestrator.cli.output import add_json_flag, table_stream, write_json

__all__ = ["add_json_flag", "logs_to_stderr", "table_stream", "write_json"]


def logs_to_stderr() -> None:
    """Send the service's log lines to stderr as `kvresume serve` does off a terminal (JSON lines, cached
    loggers), so `--json -` stays JSON and a turn's canonical log line costs what it costs in a deployed
    node (structlog's default console renderer, uncached, cost about 0.5 ms a turn more). For benchmark
    entry points only: configuring logging is the entry point's job."""
    from orchestrator.api import configure_logging

    configure_logging(json=True)
