"""`kvresume demo --json`: the scripted session shows every path the script promises, with counts that
add up turn by turn (each prompt = the previous turn's history + its new tokens)."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.cli.demo_cmd import EXPECTED_PATHS


def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    turns = json.loads(capsys.readouterr().out)
    assert tuple(t["path"] for t in turns) == EXPECTED_PATHS
    history = 0
    for t in turns:
        prompt = t["cached"] + t["mapped"] + t["prefilled"]
        assert prompt == history + t["new_tokens"]
        if t["path"] == "FULL_HIT":
            assert t["cached"] == history and t["replayed_encoder"] == 0
        if t["path"] == "COLD_PREFILL":
            assert t["cached"] == t["mapped"] == 0
        history = prompt + t["generated"]
    switch = turns[5]
    assert switch["model"] != turns[4]["model"] and "no validated mapper" in switch["reason"]
