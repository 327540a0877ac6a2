"""`kvresume session ...`: a tenant's calls to a running server (create, turn, fork, get, list, close,
delete, abort). Responses print as JSON lines; a turn prints one line per streamed event.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import grpc

from kvresume.client import bearer_metadata, message_json, open_channel, rpc_error_text
from orchestrator.api.stubs import load_stubs
from orchestrator.cli.serve_cmd import add_settings_flags, settings_from_args


def _request(pb: Any, args: argparse.Namespace) -> tuple[str, Any]:
    s = pb.sessions
    cmd = args.session_command
    if cmd == "create":
        hints = pb.common.RetentionHints()
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
        return "Abort", s.AbortRequest(session_id=args.session_id, reason=args.reason or "")
    assert cmd == "turn"
    if (args.text is None) == (args.tokens is None):
        raise ValueError("turn needs exactly one of --text or --tokens")
    gen = s.GenerationParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.seed is not None:
        gen.seed = args.seed
    req = s.TurnRequest(session_id=args.session_id, generation=gen, model=args.model or "")
    if args.text is not None:
        req.text = args.text
    else:
        req.tokens.ids.extend(int(t) for t in args.tokens.split(",") if t.strip())
    return "Turn", req


def _run(args: argparse.Namespace) -> int:
    pb = load_stubs()
    settings = settings_from_args(args)
    token = args.token or os.environ.get("KVRESUME_TOKEN", "")
    target = args.target or f"{settings.grpc_host}:{settings.grpc_port}"
    method, request = _request(pb, args)
    with open_channel(target, tls_ca_file=args.tls_ca) as channel:
        stub = pb.sessions_grpc.SessionsStub(channel)
        try:
            call = getattr(stub, method)
            if method == "Turn":
                for event in call(request, metadata=bearer_metadata(token), timeout=args.timeout):
                    print(message_json(event), flush=True)
            else:
                print(message_json(call(request, metadata=bearer_metadata(token), timeout=args.timeout)))
        except grpc.RpcError as exc:
            print(f"kvresume session: {rpc_error_text(exc)}", file=sys.stderr)
            return 1
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("session", help="a tenant's session calls to a running server")
    sub = parser.add_subparsers(dest="session_command", required=True)

    def add(name: str, help_text: str, *, with_id: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        add_settings_flags(p)
        p.add_argument("--target", help="server host:port (default: the settings' address)")
        p.add_argument("--token", help="tenant token (default: $KVRESUME_TOKEN)")
        p.add_argument("--tls-ca", help="CA bundle for a TLS server")
        p.add_argument("--timeout", type=float, default=600.0, help="RPC deadline in seconds")
        if with_id:
            p.add_argument("session_id")
        p.set_defaults(handler=_run)
        return p

    p = add("create", "create a session", with_id=False)
    p.add_argument("--model", required=True)
    p.add_argument("--retention-s", type=float, help="requested retention (clipped to the tenant's policy)")
    add("get", "show a session")
    p = add("list", "list your sessions", with_id=False)
    p.add_argument("--page-size", type=int, default=50)
    p.add_argument("--page-token")
    p.add_argument("--open-only", action="store_true")
    add("close", "close a session")
    add("delete", "delete a session and its derived data")
    p = add("fork", "fork a session at a turn")
    p.add_argument("--at-turn", type=int, required=True)
    p = add("abort", "abort the session's running turn")
    p.add_argument("--reason")
    p = add("turn", "append text or tokens and stream the generation")
    p.add_argument("--text")
    p.add_argument("--tokens", help="comma-separated token ids")
    p.add_argument("--model", help="serve this turn with another model of the family")
    p.add_argument("--max-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
