"""benchmarks.bench_decode_step: a tiny run of each mode on the shipped v41-sib-s, with `--profile`."""

from __future__ import annotations

import json

import pytest
import torch

import benchmarks.bench_decode_step as bench

pytestmark = pytest.mark.skipif(
    not (bench.DEFAULT_CHECKPOINT / "model.safetensors").is_file(),
    reason="the trained v41-sib-s is not shipped",
)


@pytest.fixture(autouse=True)
def _restore_threads():
    # the benchmark sets torch's thread count (--threads, 1 by default)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _check_profile(doc: dict, top: int) -> None:
    rows = doc["profile_top"]
    assert len(rows) == top and doc["profile_ms_per_step"] > 0
    own = [r["own_ms_per_step"] for r in rows]
    assert own == sorted(own, reverse=True) and own[-1] >= 0
    assert all(0 <= r["share"] <= 1 and r["function"] for r in rows)
    assert sum(r["share"] for r in rows) <= 1 + 1e-9
    # the profile is of the batched pass: its own code is among what it names
    assert any("batched" in r["function"] or "ragged" in r["function"] or "linear" in r["function"]
               for r in rows)  # fmt: skip


@pytest.mark.parametrize("mode", [["--prefill", "3", "--prefill-max", "5"], []], ids=["prefill", "decode"])
def test_main_times_and_profiles_the_batched_pass(tmp_path, capsys, mode: list[str]) -> None:
    path = tmp_path / "step.json"
    bench.main(["--sequences", "3", "--steps", "3", "--profile", "6", "--json", str(path), *mode])
    doc = json.loads(path.read_text())
    table = capsys.readouterr().out
    assert doc["sequences"] == 3 and doc["step_ms_batched"] > 0 and doc["batched_vs_alone"] > 0
    _check_profile(doc, 6)
    assert "cProfile of the batched pass" in table and doc["profile_top"][0]["function"] in table


def test_no_profile_without_the_flag(tmp_path) -> None:
    path = tmp_path / "step.json"
    bench.main(["--sequences", "2", "--steps", "2", "--prefill", "3", "--json", str(path)])
    assert "profile_top" not in json.loads(path.read_text())


def test_a_negative_profile_count_is_refused_naming_it(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(["--profile", "-3"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--profile" in err and "-3" in err, err
