"""benchmarks.bench_long_history: a tiny run of its code path (the history grown to each size, the turns
measured there, the ratios to the first size), not its figures."""

from __future__ import annotations

import json

import pytest

import benchmarks.bench_long_history as bench


def test_main_grows_the_history_and_measures_each_size(tmp_path, capsys, monkeypatch) -> None:
    # the entry point sends structlog to the sys.stderr of the moment (pytest's capture, closed after
    # this test): the process's logging stays as the suite configured it
    monkeypatch.setattr(bench, "logs_to_stderr", lambda: None)
    path = tmp_path / "long.json"
    assert bench.main(["--histories", "2200,300", "--turns", "3", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    sizes = doc["sizes"]
    # ascending, each size reached by growing the one session, every measured turn a full hit
    assert 300 <= sizes[0]["history_tokens"] < 2200 <= sizes[1]["history_tokens"]
    assert all(s["paths"] == ["FULL_HIT"] and s["turns"] == 3 for s in sizes)
    assert sizes[0]["p50_vs_first"] == 1.0 and sizes[1]["p50_vs_first"] > 0
    assert all(s["p90_ms"] >= s["p50_ms"] > 0 and s["cpu_ms_per_turn"] > 0 for s in sizes)
    assert doc["numerics"]["cpu_path"] in ("portable", "strict")
    assert "NO-OP STAND-IN" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--histories", "a,b"], ["--histories", "0"], ["--turns", "1"]])
def test_main_refuses_bad_arguments(argv) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
