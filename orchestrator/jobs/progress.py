"""The child-to-parent protocol of a fitting job: one JSON object per line on the child's stdout, and
the ETA the parent derives from the rows reported.

Events: {"event": "phase", "phase": "running" | "evaluating"}; {"event": "progress", "rows_done": n,
"rows_total": N}; {"event": "result", ...} (the last line of a job that finished); {"event": "error",
"message": str} (a job that could not). Anything else on stdout is a protocol error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["EVENTS", "EtaEstimator", "emit", "parse_event"]

EVENTS = ("phase", "progress", "result", "error")


def emit(stream: TextIO, event: str, **fields: Any) -> None:
    """Write one event line and flush it (the parent reads lines as they come)."""
    if event not in EVENTS:
        raise ValueError(f"unknown job event {event!r}")
    stream.write(json.dumps({"event": event, **fields}, sort_keys=True) + "\n")
    stream.flush()


def parse_event(line: str) -> dict[str, Any]:
    """One event line, checked.

    Raises:
        ValueError: not a JSON object with a known event and its fields.
    """
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"job child wrote a line that is not JSON: {line[:200]!r}") from exc
    if not isinstance(doc, dict) or doc.get("event") not in EVENTS:
        raise ValueError(f"job child wrote an unknown event: {line[:200]!r}")
    if doc["event"] == "progress":
        done, total = doc.get("rows_done"), doc.get("rows_total")
        if not (isinstance(done, int) and isinstance(total, int) and 0 <= done <= total):
            raise ValueError(f"job child reported impossible progress: {line[:200]!r}")
    if doc["event"] == "phase" and doc.get("phase") not in ("running", "evaluating"):
        raise ValueError(f"job child reported an unknown phase: {line[:200]!r}")
    return doc


@dataclass
class EtaEstimator:
    """Seconds left at the mean rate since the first report: (total - done) / (done / elapsed).

    The first report (often rows_done 0) only starts the clock; None until a rate is measured.
    """

    clock: Callable[[], float]
    _t0: float | None = None
    _done0: int = 0

    def update(self, rows_done: int, rows_total: int) -> float | None:
        now = self.clock()
        if self._t0 is None:
            self._t0, self._done0 = now, rows_done
            return None
        rows, elapsed = rows_done - self._done0, now - self._t0
        if rows <= 0 or elapsed <= 0:
            return None
        return (rows_total - rows_done) * elapsed / rows
