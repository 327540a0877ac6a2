"""benchmarks.bench_child_start: a tiny run of its code path (both arms of both helpers, alternating), not
its figures (tests/orchestrator/test_child_launcher.py compares the forked and executed children)."""

from __future__ import annotations

import json

import pytest

import benchmarks.bench_child_start as bench


@pytest.fixture(autouse=True)
def _logs_stay_where_they_are(monkeypatch) -> None:
    # the entry point sends structlog to the sys.stderr of the moment (pytest's capture, closed after the
    # test: every later test's log line would then fail)
    monkeypatch.setattr(bench, "logs_to_stderr", lambda: None)


def test_main_starts_each_helper_both_ways(tmp_path, capsys) -> None:
    path = tmp_path / "starts.json"
    assert bench.main(["--starts", "1", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert set(doc["helpers"]) == {"model_process", "registry_writer"}
    for row in doc["helpers"].values():
        assert row["starts"] == 1
        assert row["exec_ms"] > 0 and row["preloaded_ms"] > 0 and row["first_preloaded_ms"] > 0
        assert row["ratio"] == pytest.approx(row["exec_ms"] / row["preloaded_ms"])
    assert "helper process start" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--starts", "0"], ["--starts", "x"]])
def test_main_refuses_bad_arguments(argv) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
