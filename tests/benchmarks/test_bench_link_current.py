"""benchmarks.bench_link_current: a tiny run of its code path (both arms alternating, each size, SQLite and
PostgreSQL when the suite has a server), not its figures (the rows both paths leave are compared in
tests/orchestrator/db/test_link_current_twin.py)."""

from __future__ import annotations

import json
import os

import pytest

import benchmarks.bench_link_current as bench
from orchestrator.db.repositories import link_sqlite


def test_main_measures_both_arms_at_each_size(tmp_path, capsys) -> None:
    path = tmp_path / "link.json"
    argv = ["--segments", "2,9", "--calls", "3", "--json", str(path)]
    pg = os.environ.get("KVRESUME_TEST_POSTGRES_URL")
    if pg:
        argv += ["--postgres", pg]
    assert bench.main(argv) == 0
    doc = json.loads(path.read_text())
    assert set(doc["backends"]) == ({"sqlite", "postgresql"} if pg else {"sqlite"})
    for rows in doc["backends"].values():
        # each size's full chunks plus the tail each call supersedes
        assert [r["segments"] for r in rows] == [3, 10]
        assert all(r["upsert_all_ms"] > 0 and r["incremental_ms"] > 0 and r["ratio"] > 0 for r in rows)
    # the threshold is back to the default whatever the arms set
    assert link_sqlite.INCREMENTAL_FROM == bench.ARMS["incremental"]
    assert "link_current of one session" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--segments", "a"], ["--segments", "0"], ["--calls", "1"], ["--segments", ""]]
)
def test_main_refuses_bad_arguments(argv) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
