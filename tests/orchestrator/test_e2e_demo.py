"""`kvresume demo --json`: the scripted session shows every path the script promises, with counts that
add up turn by turn (each prompt = the previous turn's history + its new tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

import orchestrator.api
from orchestrator.cli import main
from orchestrator.cli.demo_cmd import demo_sources, expected_paths, shipped_mapper_dirs, switch_target


@pytest.fixture
def entry_point_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The entry point's structlog set-up, undone afterwards. As configured for a process it prints to the
    sys.stderr of the moment (this test's capture, closed afterwards) and caches each logger on first
    use, so later tests in this process would log into a closed file; here loggers are not cached, and
    the defaults come back after the test."""
    configure = orchestrator.api.configure_logging

    def uncached(**kwargs: Any) -> None:
        configure(**kwargs)
        structlog.configure(cache_logger_on_first_use=False)

    # the demo imports it from orchestrator.api when it runs
    monkeypatch.setattr(orchestrator.api, "configure_logging", uncached)
    yield
    structlog.reset_defaults()


def test_demo_json(capsys: pytest.CaptureFixture[str], entry_point_logging: None) -> None:
    # the switch is a MODEL_SWAP exactly when a shipped mapper from the first model passed its gate
    names = list(demo_sources()) or ["v41-sib-s"]
    mapped_switch = switch_target("v41-sib-s", names, shipped_mapper_dirs()) is not None
    assert main(["demo", "--json"]) == 0
    turns = json.loads(capsys.readouterr().out)
    assert tuple(t["path"] for t in turns) == expected_paths(mapped_switch=mapped_switch)
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
    assert switch["model"] != turns[4]["model"]
    if mapped_switch:
        assert switch["mapped"] > 0 and "(task retention " in switch["reason"], switch
    else:
        assert "no validated mapper" in switch["reason"]
