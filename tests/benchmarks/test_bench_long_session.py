"""benchmarks.bench_long_session: a tiny end-to-end run of its code path (two nodes, the same turns, the
twin check of tokens and stored bytes), not its figures."""

from __future__ import annotations

import json

import benchmarks.bench_long_session as bench


def test_main_runs_both_nodes_and_reports_windows(tmp_path, capsys, monkeypatch) -> None:
    # the benchmark's entry point sends structlog to the sys.stderr of the moment (pytest's capture,
    # closed after this test): the process's logging stays as the suite configured it
    monkeypatch.setattr(bench, "logs_to_stderr", lambda: None)
    path = tmp_path / "long.json"
    assert bench.main(["--turns", "3", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["full_hits"] == 3 and doc["reads_unread_chunk_hits"] == 0
    # the turns after the first full hit are served from kept state without reading the chunks
    assert doc["unread_chunk_hits"] > 0
    assert doc["windows"] and all(w["client_ratio"] > 0 and w["prepare_ratio"] > 0 for w in doc["windows"])
    assert doc["numerics"]["cpu_path"] in ("portable", "strict")
    assert "chunks served unread" in capsys.readouterr().out
