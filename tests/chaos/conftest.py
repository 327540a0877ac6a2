"""Shared pieces of the chaos suite: the JSON report its tests write their figures to.

Each test records figures under its own section with the `chaos_report` fixture; at the end of the
session the sections are merged into the report file, so runs of different files (default subset, slow
runs) accumulate in one place for the issue notes. The file is `$KVRESUME_CHAOS_REPORT` when set, else
`.chaos/report.json` under the repository root (ignored by git).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def report_path() -> Path:
    env = os.environ.get("KVRESUME_CHAOS_REPORT")
    return Path(env) if env else REPO_ROOT / ".chaos" / "report.json"


class ChaosReport:
    """Sections of figures, each a JSON object; a later write of a section replaces the earlier one."""

    def __init__(self) -> None:
        self.sections: dict[str, dict[str, Any]] = {}

    def record(self, section: str, **figures: Any) -> None:
        self.sections.setdefault(section, {}).update(figures)

    def flush(self, path: Path) -> None:
        if not self.sections:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            merged = json.loads(path.read_text())
            if not isinstance(merged, dict):
                merged = {}
        except (OSError, ValueError):
            merged = {}
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for name, figures in self.sections.items():
            merged[name] = {**figures, "recorded_at": stamp}
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)


_REPORT = ChaosReport()


@pytest.fixture(scope="session")
def chaos_report() -> Iterator[ChaosReport]:
    yield _REPORT
    _REPORT.flush(report_path())
