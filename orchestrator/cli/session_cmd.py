"""`kvresume session ...`: a tenant's calls to a running server (create, turn, fork, get, list, close,
delete, abort), through the light `kvresume` client only.

Text for people by default; `--json [PATH|-]` writes the response (a turn: one JSON line per streamed
event). `create` and `fork` print the new session's id alone on stdout (`SID=$(kvresume session create
...)`), their details on stderr. A turn in text mode prints its plan to stderr, the generated text to
stdout as it streams, and a stats line to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from orchestrator.cli.connection import TENANT, add_connection_flags, connect
from orchestrator.cli.output import add_json_flag, json_lines, table_text, text_stream, write_json


def _dict(message: Any) -> dict[str, Any]:
    from kvresume import message_json

    return json.loads(message_json(message))


def _short(enum_value: str, prefix: str) -> str:
    return enum_value.removeprefix(prefix)


def _session_line(s: dict[str, Any]) -> str:
    parent = f", forked from {s['parent_session_id']} at turn {s.get('forked_at_turn', 0)}" if s.get(
        "parent_session_id"
    ) else ""
    return (
        f"session {s['session_id']} (tenant {s['tenant_id']}, model {s['model']}, "
        f"{_short(s['status'], 'SESSION_STATUS_').lower()}, {s['turn_count']} turns, "
        f"{s['history_tokens']} history tokens, retention {s['retention_s']:.0f} s{parent})"
    )


def _request(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import common_pb2
    from kvresume.v1 import sessions_pb2 as s

    cmd = args.session_command
    if cmd == "create":
        hints = common_pb2.RetentionHints()
        if args.retention_s is not None:
            hints.retention_s = args.retention_s
        return "CreateSession", s.CreateSessionRequest(model=args.model, retention=hints)
    if cmd == "get":
        return "GetSession", s.GetSessionRequest(session_id=args.session_id)
    if cmd == "list":
        return "ListSessions", s.ListSessionsRequest(
            page_size=args.page_size, page_token=args.page_token or "", open_only=args.open_only
        )
    if cmd == "close":
        return "CloseSession", s.CloseSessionRequest(session_id=args.session_id)
    if cmd == "delete":
        return "DeleteSession", s.DeleteSessionRequest(session_id=args.session_id)
    if cmd == "fork":
        return "ForkSession", s.ForkSessionRequest(session_id=args.session_id, at_turn=args.at_turn)
    if cmd == "abort":
        if not args.session_id and not args.request_id:
            raise ValueError("abort needs a session id or --request-id")
        return "Abort", s.AbortRequest(
            session_id=args.session_id or "",
            reason=args.reason or "",
            request_id=args.request_id or "",
            keep_partial=args.keep_partial,
        )
    assert cmd == "turn"
    if (args.text is None) == (args.tokens is None):
        raise ValueError("turn needs exactly one of --text or --tokens")
    gen = s.GenerationParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.seed is not None:
        gen.seed = args.seed
    req = s.TurnRequest(
        session_id=args.session_id, generation=gen, model=args.model or "", request_id=args.request_id or ""
    )
    if args.text is not None:
        req.text = args.text
    else:
        try:
            req.tokens.ids.extend(int(t) for t in args.tokens.split(",") if t.strip())
        except ValueError as exc:
            raise ValueError(f"--tokens must be comma-separated token ids, got {args.tokens!r}") from exc
    return "Turn", req


def _show(args: argparse.Namespace, doc: dict[str, Any]) -> int:
    """Text of a unary response (and, for create/fork, the id on stdout); the JSON document."""
    cmd, out = args.session_command, text_stream(args.json)
    if cmd in ("create", "fork"):
        session = doc["session"]
        print(session["session_id"], file=out, flush=True)
        granted = ""
        if cmd == "create":
            outcome = _short(doc["retention_outcome"], "RETENTION_OUTCOME_").lower()
            granted = f"; retention {outcome}"
        print(f"created {_session_line(session)}{granted}", file=sys.stderr)
    elif cmd in ("get", "close"):
        print(_session_line(doc), file=out)
    elif cmd == "list":
        rows = [
            {**s, "status": _short(s["status"], "SESSION_STATUS_").lower()} for s in doc["sessions"]
        ]
        columns = (("session", "session_id"), ("model", "model"), ("status", "status"),
                   ("turns", "turn_count"), ("history", "history_tokens"), ("updated", "updated_at"))
        print(table_text(rows, columns) if rows else "no sessions", file=out)
        if doc["next_page_token"]:
            print(f"more: --page-token {doc['next_page_token']}", file=out)
    elif cmd == "delete":
        print(f"deleted session {args.session_id}: {doc['segments_deleted']} segments, "
              f"{doc['bytes_deleted']} bytes", file=out)
    elif cmd == "abort":
        if doc["aborted"]:
            print(f"aborted turn {doc['request_id']} of session {doc['session_id']}", file=out)
        else:
            print("no running turn matched (it may have finished already)", file=out)
    write_json(doc, args.json)
    return 0


def _plan_text(plan: dict[str, Any]) -> str:
    c = plan["counts"]
    persist = "yes" if plan["persist"] else f"no ({plan['persist_note']})"
    source = f", from {plan['source_model']}" if plan["source_model"] else ""
    mapper = f" via mapper {plan['mapper_id']}" if plan["mapper_id"] else ""
    return (
        f"plan: turn {plan['turn_index']} {_short(plan['path'], 'RESUME_PATH_')} on {plan['model']}"
        f"{source}{mapper}: {plan['reason']} [prompt {plan['prompt_tokens']}: cached {c['cached']}, "
        f"mapped {c['mapped']}, prefilled {c['prefilled']}; persist {persist}]"
    )


def _stats_text(stats: dict[str, Any]) -> str:
    c = stats["counts"]
    finish = _short(stats["finish_reason"], "FINISH_REASON_").lower()
    replayed = f"{c['replayed_encoder']}+{c['replayed_decoder']}"
    return (
        f"stats: {stats['generated_tokens']} tokens ({finish}), "
        f"ttft {stats['ttft_s'] * 1000:.0f} ms, {stats['decode_tokens_per_s']:.1f} tokens/s, "
        f"total {stats['total_s']:.2f} s; prompt {stats['prompt_tokens']} (cached {c['cached']}, mapped "
        f"{c['mapped']}, prefilled {c['prefilled']}, replayed {replayed}); "
        f"persisted {'yes' if stats['persisted'] else 'no'}, stored {stats['stored_tokens']}, "
        f"kept {'yes' if stats['kept'] else 'no'}; request {stats['request_id']}"
    )


def _stream_turn(args: argparse.Namespace, events: Any) -> int:
    out = text_stream(args.json)
    ended_line = True
    with json_lines(args.json) as emit:
        for event in events:
            doc = _dict(event)
            emit(doc)
            if "plan" in doc:
                print(_plan_text(doc["plan"]), file=sys.stderr, flush=True)
            elif "tokens" in doc:
                text = doc["tokens"].get("text", "")
                if text:
                    print(text, end="", file=out, flush=True)
                    ended_line = text.endswith("\n")
            elif "stats" in doc:
                if not ended_line:
                    print(file=out, flush=True)
                    ended_line = True
                print(_stats_text(doc["stats"]), file=sys.stderr, flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    method, request = _request(args)
    with connect(args) as client:
        answer = client.call("sessions", method, request)
        if method == "Turn":
            return _stream_turn(args, answer)
        return _show(args, _dict(answer))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("session", help="a tenant's session calls to a running server (client)")
    sub = parser.add_subparsers(dest="session_command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, *, with_id: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        if with_id:
            p.add_argument("session_id")
        add_connection_flags(p, role=TENANT, timeout_s=600.0)
        add_json_flag(p, what="the response" if name != "turn" else "each streamed event (JSON lines)")
        p.set_defaults(handler=_run)
        return p

    p = add("create", "create a session; prints its id (details on stderr)", with_id=False)
    p.add_argument("--model", required=True)
    p.add_argument("--retention-s", type=float, help="requested retention (clipped to the tenant's policy)")
    add("get", "show a session")
    p = add("list", "list your sessions", with_id=False)
    p.add_argument("--page-size", type=int, default=50)
    p.add_argument("--page-token")
    p.add_argument("--open-only", action="store_true")
    add("close", "close a session")
    add("delete", "delete a session and its derived data")
    p = add("fork", "fork a session at a turn; prints the new session's id")
    p.add_argument("--at-turn", type=int, required=True)
    p = add("abort", "stop a running turn (by session, by --request-id, or both)", with_id=False)
    p.add_argument("session_id", nargs="?", help="the session whose running turn to stop")
    p.add_argument("--request-id", help="stop the running turn with this request id")
    p.add_argument(
        "--keep-partial",
        action="store_true",
        help="keep the turn's input and the tokens streamed so far in the history (default: keep nothing)",
    )
    p.add_argument("--reason", help="recorded with the aborted turn")
    p = add("turn", "append text or tokens and stream the generation")
    p.add_argument("--text", help="appended to the history as is (no chat template; see orchestrator/README)")
    p.add_argument("--tokens", help="comma-separated token ids")
    p.add_argument("--model", help="serve this turn with another model of the family")
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus cut (0 or 1: none)")
    p.add_argument("--top-k", type=int, default=0, help="top-k cut (0: none)")
    p.add_argument("--seed", type=int, help="seed of the sampling (reproducible)")
    p.add_argument("--request-id", help="this turn's id, for logs and `session abort --request-id`")
