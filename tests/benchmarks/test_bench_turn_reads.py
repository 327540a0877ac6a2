"""benchmarks.bench_turn_reads: a tiny run of its code path (both arms alternating, alone and contended, each
size), not its figures (the two reads are compared on random sessions in
tests/orchestrator/db/test_repositories.py)."""

from __future__ import annotations

import json

import pytest

import benchmarks.bench_turn_reads as bench


def test_main_times_both_reads_at_each_size(tmp_path, capsys) -> None:
    path = tmp_path / "reads.json"
    assert bench.main(["--turns", "1,7", "--reads", "4", "--contenders", "2", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert [r["turns"] for r in doc["sizes"]] == [1, 7]
    for r in doc["sizes"]:
        assert r["history_tokens"] == r["turns"] * (bench.NEW_TOKENS + bench.GENERATED)
        # one row against the facts, each turn, the policy and each span
        assert r["rows_fetched"] == {"one_statement": 1, "four_statements": 2 + r["turns"] + r["spans"]}
        for setting in ("alone_ms", "contended_ms"):
            assert set(r[setting]) == set(bench.ARMS) and all(v > 0 for v in r[setting].values())
        assert r["ratio_alone"] > 0 and r["ratio_contended"] > 0
    assert "a turn's registry reads" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--turns", "a"], ["--turns", "0"], ["--turns", ""], ["--reads", "1"], ["--contenders", "0"]]
)
def test_main_refuses_bad_arguments(argv) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
