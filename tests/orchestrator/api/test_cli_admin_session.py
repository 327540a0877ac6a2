"""`kvresume admin ...` and `kvresume session ...` against an in-process server; `admin migrate` locally."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from orchestrator.cli import main
from tests.orchestrator.api.conftest import ADMIN_TOKEN


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    """The JSON document a command wrote to stdout (`--json`)."""
    return json.loads(capsys.readouterr().out)


def test_admin_migrate_and_local_audit_verify(tmp_path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
    assert main(["admin", "migrate", "--database-url", url]) == 0
    assert capsys.readouterr().out == "database at revision head\n"
    assert main(["admin", "audit-local", "--database-url", url, "--data-dir", str(tmp_path), "--json"]) == 0
    doc = _json(capsys)
    # No store in the data dir and no anchor key: the SQL chains alone, "unanchored".
    keys = ("ok", "verdict", "records", "reason", "head_seq", "head_hash", "problems")
    assert {k: doc[k] for k in keys} == {
        "ok": True,
        "verdict": "unanchored",
        "records": 0,
        "reason": "",
        "head_seq": 0,
        "head_hash": "0" * 64,
        "problems": [],
    }
    assert "first_break_seq" not in doc and "store_chain" not in doc
    assert main(["admin", "downgrade", "--database-url", url, "--revision", "base"]) == 0


@pytest.fixture
def quiet_server() -> Iterator[None]:
    """The server's log lines captured, so stdout holds only what the command printed."""
    with capture_logs():
        yield


def test_session_and_admin_commands_over_grpc(service, capsys, quiet_server) -> None:
    target = ["--target", f"127.0.0.1:{service.server.port}"]
    tenant = [*target, "--token", "tok-acme"]
    admin = [*target, "--token", ADMIN_TOKEN]
    assert main(["session", "create", "--model", "small", "--retention-s", "120", *tenant, "--json"]) == 0
    created = _json(capsys)
    sid = created["session"]["session_id"]
    assert created["session"]["tenant_id"] == "acme"
    assert main(["session", "get", sid, *tenant, "--json"]) == 0
    assert _json(capsys)["session_id"] == sid
    # Another tenant: NOT_FOUND, exit code 1, the status on stderr.
    assert main(["session", "get", sid, *target, "--token", "tok-globex"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert main(["session", "turn", sid, "--text", "hi", *tenant]) == 1
    assert "UNIMPLEMENTED" in capsys.readouterr().err
    retention = ["admin", "retention", "set", "--tenant", "acme", "--floor-s", "10", "--ceiling-s", "99"]
    assert main([*retention, *admin, "--json"]) == 0
    assert _json(capsys)["ceiling_s"] == 99
    assert main(["admin", "retention", "get", "--tenant", "acme", *admin]) == 0
    assert capsys.readouterr().out == "retention of acme: floor 10 s, ceiling 99 s\n"
    assert main(["admin", "audit", "verify", *admin, "--json"]) == 0
    assert _json(capsys)["ok"] is True
    assert main(["admin", "purge", "--session", sid, *admin]) == 0
    assert capsys.readouterr().out == "purged 1 sessions, 0 segments, 0 bytes\n"
    assert main(["admin", "stats", "--tenant", "acme", *admin, "--json"]) == 0
    assert _json(capsys)["region"] == "eu-1"
    assert main(["admin", "stats", *target, "--token", "tok-acme"]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


@pytest.mark.slow
def test_admin_calibrate_writes_a_cost_table_the_planner_loads(tmp_path, capsys) -> None:
    from orchestrator.planner import CostTable

    out = tmp_path / "costs.json"
    assert (
        main(
            [
                "admin",
                "calibrate",
                "--preset",
                "v41-tiny",
                "--model-name",
                "tiny",
                "--sizes",
                "4,8",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    costs = CostTable.load(out).for_model("tiny")
    # Timings on a shared CPU are noisy at these tiny sizes, so only the artifact's shape is pinned here.
    assert "tiny" in CostTable.load(out).models and costs.source == str(out)
    assert capsys.readouterr().out.startswith(f"per-token costs of tiny written to {out}:")
