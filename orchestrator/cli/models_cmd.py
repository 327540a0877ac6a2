"""`kvresume models ...`: what a running server serves (the Models service): list, get, and its tokenizer
(tokenize, detokenize; `tokenize --chat FILE` renders OpenAI-style messages with the chat template
first), through the light `kvresume` client only. Any valid token may call it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from orchestrator.cli.connection import ANY, add_connection_flags, connect
from orchestrator.cli.output import add_json_flag, fields_text, table_text, text_stream, write_json

_COLUMNS = (
    ("name", "name"), ("vocab", "vocab_size"), ("window", "window"), ("context", "max_context_tokens"),
    ("kv B/token", "kv_bytes_per_token"), ("tokenizer", "tokenizer"), ("source", "source"),
)  # fmt: skip


def _request(args: argparse.Namespace) -> tuple[str, Any]:
    from kvresume.v1 import models_pb2 as m

    cmd = args.models_command
    if cmd == "list":
        return "ListModels", m.ListModelsRequest()
    if cmd == "get":
        return "GetModel", m.GetModelRequest(name=args.name)
    if cmd == "tokenize":
        return "Tokenize", m.TokenizeRequest(model=args.name, text=_tokenize_text(args))
    assert cmd == "detokenize"
    try:
        ids = [int(t) for t in args.ids.split(",") if t.strip()]
    except ValueError as exc:
        raise ValueError(f"ids must be comma-separated token ids, got {args.ids!r}") from exc
    return "Detokenize", m.DetokenizeRequest(model=args.name, ids=ids)


def _tokenize_text(args: argparse.Namespace) -> str:
    """The text to tokenize: the argument, or the chat template's text of the --chat file's messages."""
    if (args.text is None) == (args.chat is None):
        raise ValueError("give either TEXT or --chat FILE")
    if args.chat is None:
        return args.text
    # stdlib only (the light client stays light)
    from orchestrator.chat import ChatMessage, ToolCall, render_text

    with open(args.chat, encoding="utf-8") as fh:
        raw = json.load(fh)
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ValueError(f"{args.chat}: want a JSON list of messages ({{'role': ..., 'content': ...}})")
    messages = []
    for i, m in enumerate(raw):
        calls = tuple(
            ToolCall(name=c["function"]["name"], arguments=c["function"].get("arguments", ""))
            for c in m.get("tool_calls") or ()
        )
        role = "system" if m.get("role") == "developer" else m.get("role")
        try:
            messages.append(ChatMessage(role=role, content=m.get("content") or "", tool_calls=calls))
        except ValueError as exc:
            raise ValueError(f"{args.chat}: message {i}: {exc}") from exc
    return render_text(messages)


def _text(cmd: str, doc: dict[str, Any]) -> str:
    if cmd == "list":
        return table_text(doc["models"], _COLUMNS) if doc["models"] else "no models served"
    if cmd == "get":
        return fields_text(doc)
    if cmd == "tokenize":
        return f"{doc['count']} tokens: {','.join(str(i) for i in doc['ids'])}"
    return doc["text"]


def _run(args: argparse.Namespace) -> int:
    from kvresume import message_json

    method, request = _request(args)
    with connect(args) as client:
        doc = json.loads(message_json(client.call("models", method, request)))
    print(_text(args.models_command, doc), file=text_stream(args.json))
    write_json(doc, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models", help="the models a running server serves, and their tokenizer (client)"
    )
    sub = parser.add_subparsers(dest="models_command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        add_connection_flags(p, role=ANY)
        add_json_flag(p, what="the response")
        p.set_defaults(handler=_run)
        return p

    add("list", "the served models with their limits, tokenizer and source")
    p = add("get", "one model: fingerprint, numerics profile, limits, tokenizer")
    p.add_argument("name", help="the model's name")
    p = add("tokenize", "the token ids a turn with this text would append")
    p.add_argument("name", help="the model's name")
    p.add_argument("text", nargs="?", help="the text, exactly as a turn's --text would send it")
    p.add_argument(
        "--chat",
        metavar="FILE",
        help="instead of TEXT: a JSON list of OpenAI-style messages, rendered with the chat template "
        "(the text the HTTP API's ids come from)",
    )
    p = add("detokenize", "the text of token ids")
    p.add_argument("name", help="the model's name")
    p.add_argument("ids", help="comma-separated token ids")
