"""`kvresume session ...` against a real serving node (turn engine over seeded random-init models): the
text output for people, `--json [PATH|-]`, a turn's text mode and JSON lines, and `abort` by request id
with `--keep-partial`."""

from __future__ import annotations

import json

import pytest
from structlog.testing import capture_logs

from orchestrator.cli import main
from tests.orchestrator.engine.node_harness import TOKENS, md, registry, start_node


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    # the server's log lines are captured, so stdout and stderr hold only what the command printed
    with capture_logs():
        n = start_node(tmp_path_factory.mktemp("cli-session"), registry(), max_sessions_per_tenant=50)
        try:
            yield n
        finally:
            n.stop()


@pytest.fixture
def tenant(node) -> list[str]:
    return ["--target", f"127.0.0.1:{node.server.port}", "--token", TOKENS["acme"]]


def _create(tenant: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["session", "create", "--model", "a", *tenant]) == 0
    return capsys.readouterr().out.strip()


def test_session_create_prints_the_id_alone_and_list_shows_it(node, tenant, capsys, tmp_path) -> None:
    assert main(["session", "create", "--model", "a", "--retention-s", "120", *tenant]) == 0
    captured = capsys.readouterr()
    sid = captured.out.strip()
    # stdout is the id alone (`SID=$(kvresume session create ...)`), the details go to stderr
    assert len(sid) == 32 and "\n" not in sid
    assert captured.err.startswith(f"created session {sid} (tenant acme, model a, open, 0 turns")
    # 120 s is below the tenant's floor (the default 72 h): clipped, and said so
    assert captured.err.rstrip().endswith("retention 259200 s); retention clipped")
    assert main(["session", "list", *tenant]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["session", "model", "status", "turns", "history", "updated"]
    assert any(line.split()[:4] == [sid, "a", "open", "0"] for line in table[1:])
    # --json: the response as one document on stdout, the text on stderr
    assert main(["session", "get", sid, *tenant, "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert (doc["session_id"], doc["status"], doc["retention_s"]) == (sid, "SESSION_STATUS_OPEN", 259200.0)
    assert captured.err.startswith(f"session {sid} (tenant acme")
    # --json PATH: the document in the file, the text on stdout
    path = tmp_path / "list.json"
    assert main(["session", "list", *tenant, "--json", str(path)]) == 0
    assert sid in capsys.readouterr().out
    assert sid in [s["session_id"] for s in json.loads(path.read_text())["sessions"]]


def test_session_turn_text_mode_streams_text_to_stdout_and_plan_and_stats_to_stderr(
    node, tenant, capsys
) -> None:
    text_sid, json_sid = _create(tenant, capsys), _create(tenant, capsys)
    turn = ["--text", "def resume(self, sid):", "--max-new-tokens", "5"]
    assert main(["session", "turn", text_sid, *turn, *tenant]) == 0
    text = capsys.readouterr()
    # the same turn on an identical session, as JSON lines: one object per streamed event
    assert main(["session", "turn", json_sid, *turn, *tenant, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    events = [json.loads(line) for line in lines]
    assert [next(iter(e)) for e in events] == ["plan", *["tokens"] * 5, "stats"]
    streamed = "".join(e["tokens"]["text"] for e in events[1:-1])
    assert text.out == streamed + ("" if streamed.endswith("\n") else "\n")
    err = text.err.splitlines()
    assert err[0].startswith("plan: turn 0 COLD_PREFILL on a: ") and "persist yes" in err[0]
    assert err[-1].startswith("stats: 5 tokens (length), ttft ") and "persisted yes" in err[-1]
    stats = events[-1]["stats"]
    assert stats["finish_reason"] == "FINISH_REASON_LENGTH" and stats["kept"] is True
    # a turn by token ids, on the stored history: a full hit
    assert main(["session", "turn", text_sid, "--tokens", "20,21,22", "--max-new-tokens", "2", *tenant]) == 0
    assert capsys.readouterr().err.startswith("plan: turn 1 FULL_HIT on a")


def test_session_abort_by_request_id_keeps_the_partial_turn(node, tenant, capsys) -> None:
    pb = node.pb
    sid = _create(tenant, capsys)
    request = pb.sessions.TurnRequest(
        session_id=sid,
        tokens=pb.sessions.TokenIds(ids=list(range(20, 60))),
        generation=pb.sessions.GenerationParams(max_new_tokens=60),
        request_id="cli-abort",
    )
    events = iter(node.sessions.Turn(request, metadata=md()))
    assert next(events).WhichOneof("event") == "plan"
    streamed = list(next(events).tokens.ids)
    assert main(["session", "abort", "--request-id", "cli-abort", "--keep-partial", *tenant]) == 0
    assert capsys.readouterr().out.strip() == f"aborted turn cli-abort of session {sid}"
    stats = None
    for event in events:
        if event.WhichOneof("event") == "tokens":
            streamed += list(event.tokens.ids)
        else:
            stats = event.stats
    assert stats is not None and stats.finish_reason == pb.sessions.FINISH_REASON_ABORTED and stats.kept
    assert main(["session", "get", sid, *tenant, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["turn_count"], int(doc["history_tokens"])) == (1, 40 + len(streamed))
    # nothing running now: the call succeeds and says so
    assert main(["session", "abort", sid, *tenant, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["aborted"] is False
    assert "no running turn matched" in captured.err


def test_session_abort_needs_a_session_or_a_request_id(tenant, capsys) -> None:
    assert main(["session", "abort", *tenant]) == 1
    err = capsys.readouterr().err
    assert err == "kvresume session abort: error: abort needs a session id or --request-id\n"


def test_session_turn_of_another_tenant_fails_with_one_line(node, tenant, capsys) -> None:
    sid = _create(tenant, capsys)
    other = ["--target", f"127.0.0.1:{node.server.port}", "--token", TOKENS["globex"]]
    assert main(["session", "turn", sid, "--text", "hi", *other]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvresume session turn: error: NOT_FOUND [SESSION_NOT_FOUND]: ")
    assert err.count("\n") == 1
