"""The one JSON option every benchmark takes: `--json [PATH|-]` (a file, or stdout with the table on
stderr). The option and the writing are the `kvresume` command line's own (orchestrator/cli/output.py),
so benchmarks and commands behave alike; this module adds what only benchmark entry points do (their
logging, their options that take a list of counts)."""

from __future__ import annotations

import argparse

from orchestrator.cli.output import add_json_flag, table_stream, write_json

__all__ = ["add_json_flag", "counts_arg", "logs_to_stderr", "table_stream", "write_json"]


def logs_to_stderr() -> None:
    """Send the service's log lines to stderr as `kvresume serve` does off a terminal (JSON lines, cached
    loggers), so `--json -` stays JSON and a turn's canonical log line costs what it costs in a deployed
    node (structlog's default console renderer, uncached, cost about 0.5 ms a turn more). For benchmark
    entry points only: configuring logging is the entry point's job."""
    from orchestrator.api import configure_logging

    configure_logging(json=True)


def counts_arg(parser: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """The comma-separated counts >= 1 of option `flag` (its value `text`), in the order given; exits
    through `parser.error`, naming the option and its value, on anything else."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag}={text!r} must be comma-separated counts")
    if not counts or min(counts) < 1:
        parser.error(f"{flag}={text!r} must name counts >= 1")
    return counts
