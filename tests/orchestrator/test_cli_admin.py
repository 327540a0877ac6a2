"""`kvresume admin residency|retention|...` against a real serving node: a residency that excludes the
node's region is said on stderr in every output mode (and kept in the JSON's `warning`), and the turns
that follow are served without persisting, as the warning says (issue 15 item 3)."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from orchestrator.cli import main
from tests.orchestrator.engine.node_harness import ADMIN, TOKENS, registry, start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    with capture_logs():
        n = start_node(tmp_path_factory.mktemp("cli-admin"), registry(), region="eu-1")
        try:
            yield n
        finally:
            n.stop()


@pytest.fixture
def target(node) -> list[str]:
    return ["--target", f"127.0.0.1:{node.server.port}"]


def test_residency_excluding_this_node_warns_and_turns_stop_persisting(target, capsys) -> None:
    admin = [*target, "--token", ADMIN]
    tenant = [*target, "--token", TOKENS["globex"]]
    # a policy that keeps the node's region: no warning
    assert main(["admin", "residency", "set", "--tenant", "globex", "--regions", "eu-1,us-1", *admin]) == 0
    captured = capsys.readouterr()
    assert captured.out == "residency of globex: eu-1, us-1; node region eu-1\n" and captured.err == ""
    # one that excludes it: the server's warning on stderr, in text mode...
    assert main(["admin", "residency", "set", "--tenant", "globex", "--regions", "us-1", *admin]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("kvresume admin residency: warning: ")
    assert "'eu-1'" in captured.err and "without persisting" in captured.err
    assert captured.out == "residency of globex: us-1; node region eu-1\n"
    # ...and with --json too, where the document keeps it
    residency = ["admin", "residency", "set", "--tenant", "globex", "--regions", "us-1"]
    assert main([*residency, *admin, "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["warning"] and doc["warning"] in captured.err and doc["node_region"] == "eu-1"
    # what it warned of: the tenant's turns here are not persisted
    assert main(["session", "create", "--model", "a", *tenant]) == 0
    sid = capsys.readouterr().out.strip()
    assert main(["session", "turn", sid, "--tokens", "20,21,22", "--max-new-tokens", "1", *tenant]) == 0
    err = capsys.readouterr().err
    assert "persist no (residency" in err and "persisted no, stored 0" in err
    # anywhere again: no warning, and turns persist
    assert main(["admin", "residency", "set", "--tenant", "globex", "--regions", "", *admin]) == 0
    captured = capsys.readouterr()
    assert captured.out == "residency of globex: anywhere; node region eu-1\n" and captured.err == ""
    assert main(["session", "turn", sid, "--tokens", "23", "--max-new-tokens", "1", *tenant]) == 0
    assert "persisted yes" in capsys.readouterr().err


def test_residency_set_needs_regions(target, capsys) -> None:
    assert main(["admin", "residency", "set", "--tenant", "acme", *target, "--token", ADMIN]) == 1
    assert "residency set needs --regions" in capsys.readouterr().err


def test_admin_calls_need_the_admin_token(target, monkeypatch, capsys) -> None:
    monkeypatch.delenv("KVRESUME_ADMIN_TOKEN", raising=False)
    assert main(["admin", "stats", *target]) == 1
    assert capsys.readouterr().err == (
        "kvresume admin stats: error: no admin token: pass --token or set KVRESUME_ADMIN_TOKEN\n"
    )
    assert main(["admin", "stats", *target, "--token", TOKENS["acme"]]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    monkeypatch.setenv("KVRESUME_ADMIN_TOKEN", ADMIN)
    assert main(["admin", "stats", *target]) == 0
    assert "region:            eu-1" in capsys.readouterr().out
