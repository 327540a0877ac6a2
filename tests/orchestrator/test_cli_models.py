"""`kvresume models list|get|tokenize|detokenize` against a real serving node."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from orchestrator.cli import main
from tests.orchestrator.engine.node_harness import ADMIN, TOKENS, registry, start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    with capture_logs():
        n = start_node(tmp_path_factory.mktemp("cli-models"), registry())
        try:
            yield n
        finally:
            n.stop()


@pytest.fixture
def caller(node) -> list[str]:
    return ["--target", f"127.0.0.1:{node.server.port}", "--token", TOKENS["acme"]]


def test_models_list_and_get(node, caller, capsys) -> None:
    assert main(["models", "list", *caller]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0][:4] == ["name", "vocab", "window", "context"]
    assert [(r[0], r[1], r[2]) for r in rows[1:]] == [("a", "512", "32"), ("b", "512", "32")]
    assert main(["models", "get", "a", *caller, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fingerprint"] == node.service.registry.get("a").fingerprint_hex
    assert doc["tokenizer"] == "bytes" and doc["source"] == "random:v41-tiny@1"
    # the admin token may read the catalogue too; text is one `field: value` line each
    admin = ["--target", f"127.0.0.1:{node.server.port}", "--token", ADMIN]
    assert main(["models", "get", "b", *admin]) == 0
    out = capsys.readouterr().out
    assert "name:               b\n" in out and "source:             random:v41-tiny@2\n" in out
    assert main(["models", "get", "c", *caller]) == 1
    assert "NOT_FOUND [MODEL_NOT_SERVED]" in capsys.readouterr().err


def test_models_tokenize_and_detokenize_round_trip(caller, capsys) -> None:
    # the byte tokenizer: id = 16 + UTF-8 byte
    assert main(["models", "tokenize", "a", "hé", *caller]) == 0
    assert capsys.readouterr().out == "3 tokens: 120,211,185\n"
    assert main(["models", "tokenize", "a", "hé", *caller, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"count": 3, "ids": [120, 211, 185]}
    assert main(["models", "detokenize", "a", "120,211,185", *caller]) == 0
    assert capsys.readouterr().out == "hé\n"
