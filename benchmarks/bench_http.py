"""The HTTP front door's cost per turn: one 20-turn agent session sent as stateless full-history requests over
HTTP (streaming, SSE) against the same session over gRPC (one session, each turn's new tokens), on one node
with the trained v41-sib-s served by a child process (clients and server do not share an interpreter lock).

Per turn: the client's time to first token (request sent to the first streamed token), the engine's
(stats.ttft_s, reported by both APIs), and overhead = client TTFT - engine TTFT: what the front door, its
transport and the client add (HTTP: auth, pydantic validation, rendering the whole conversation with the
chat template, the session mapping, a new registry session per request, the thread hop, SSE; gRPC: the
servicer and the stream). Also the cached share of each prompt and the path. The HTTP client of the headline
series is httpx (a bare client, as the gRPC side's is the generated stub); two more series send the same
requests with a `prompt_cache_key` (only the suffix goes to the engine) and through the official openai
client (its own request building counts in its client TTFT). The series are interleaved turn by turn, each
under a tenant of its own (no reuse across them). Refuses to report unless both APIs
generate the same tokens on every turn (the HTTP answers re-rendered from the generated ids must continue
exactly the history the gRPC session holds).

Run: python -m benchmarks.bench_http [--turns 20] [--max-new-tokens 8] [--think-ms 50] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import torch

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from orchestrator.api import build_server, load_stubs
from orchestrator.chat import END, ChatMessage, ChatTemplate
from orchestrator.engine import BpeCodec, ModelRegistry, ServedModelSpec, build_node, repo_root
from orchestrator.http import start_http_server
from orchestrator.settings import Settings

MODEL = "v41-sib-s"
TOKENS = {"grpc": "tok-grpc", "http": "tok-http", "keyed": "tok-keyed", "openai": "tok-openai"}
SYSTEM = (
    "You are a coding agent working in a Python repository. Read files with read_file, run the tests with "
    "run_tests, and explain each fix in one sentence. "
) * 6
RESULTS = [
    "def resume(self, sid):\n    return self.rows[sid]\n",
    "1 failed: KeyError 'sid-42' in resume()",
    "class Store:\n    def __init__(self):\n        self.rows = {}\n",
    "all 12 passed",
    "tests/test_store.py::test_resume_unknown FAILED",
]


def _conversation(turns: int, seed: int) -> list[list[dict[str, str]]]:
    """The new messages of each turn (before the answer): the first turn's system and user message, then a
    tool result per turn."""
    rng = random.Random(seed)
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Fix the KeyError in resume()."},
    ]
    return [first] + [
        [{"role": "tool", "content": rng.choice(RESULTS) + f" (run {k})"}] for k in range(1, turns)
    ]


def _grpc_turn(stubs: Any, channel: grpc.Channel, sid: str, ids: list[int], max_new: int) -> dict[str, Any]:
    stub = stubs.sessions_grpc.SessionsStub(channel)
    request = stubs.sessions.TurnRequest(
        session_id=sid,
        tokens=stubs.sessions.TokenIds(ids=ids),
        generation=stubs.sessions.GenerationParams(
            max_new_tokens=max_new, temperature=0.0, stop_token_ids=[END]
        ),
    )
    t0 = time.perf_counter()
    first = None
    plan = stats = None
    out: list[int] = []
    for event in stub.Turn(request, metadata=(("authorization", f"Bearer {TOKENS['grpc']}"),)):
        kind = event.WhichOneof("event")
        if kind == "plan":
            plan = event.plan
        elif kind == "tokens":
            if first is None:
                first = time.perf_counter() - t0
            out += list(event.tokens.ids)
        else:
            stats = event.stats
    assert plan is not None and stats is not None and first is not None
    prompt = stats.counts.cached + stats.counts.mapped + stats.counts.prefilled
    return {
        "path": stubs.common.ResumePath.Name(plan.path).removeprefix("RESUME_PATH_"),
        "client_ttft_ms": 1e3 * first,
        "engine_ttft_ms": 1e3 * stats.ttft_s,
        "cached_share": (stats.counts.cached + stats.counts.mapped) / prompt,
        "prompt_tokens": prompt,
        "out": out,
    }


def _sse_turn(client: httpx.Client, url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    text = ""
    last: dict[str, Any] | None = None
    headers = {"Authorization": f"Bearer {token}"}
    with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise SystemExit(f"HTTP {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                if first is None:
                    first = time.perf_counter() - t0
                text += chunk["choices"][0]["delta"]["content"]
            if chunk.get("usage"):
                last = chunk
    assert last is not None
    return _http_row(t0, first, text, last["usage"], last["kvresume"])


def _openai_turn(client: openai.OpenAI, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    stream = client.chat.completions.create(**body)
    first = None
    text = ""
    usage = ext = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage, ext = chunk.usage.model_dump(), chunk.model_extra["kvresume"]
    assert usage is not None and ext is not None
    return _http_row(t0, first, text, usage, ext)


def _http_row(t0: float, first: float | None, text: str, usage: dict, ext: dict) -> dict[str, Any]:
    # an answer whose only token is the stop token streams no text: its first token is the end
    first = time.perf_counter() - t0 if first is None else first
    return {
        "path": ext["path"].removeprefix("RESUME_PATH_"),
        "client_ttft_ms": 1e3 * first,
        "engine_ttft_ms": 1e3 * ext["ttft_s"],
        "cached_share": usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "text": text,
    }


def _serve(data_dir: Path, ports: Any, stop: Any) -> None:
    """The node, in a child process: sends (gRPC port, HTTP port), serves until `stop` is set."""
    from model import configure_torch
    from orchestrator.numerics_env import resolve_cpu_path

    configure_torch(resolve_cpu_path("auto"), threads=1)
    logs_to_stderr()
    ckpt = repo_root() / "checkpoints" / MODEL
    registry = ModelRegistry({MODEL: ServedModelSpec(name=MODEL, checkpoint=ckpt)})
    settings = Settings(
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir / 'registry.sqlite3'}",
        tenant_tokens=TOKENS,
        admin_token="tok-admin",
        grpc_port=0,
        metrics_enabled=False,
        region="eu-1",
        kv_chunk_tokens=32,
        grpc_workers=16,
    )
    service = build_node(settings, registry=registry, preload=True)
    server = build_server(service.ctx, host="127.0.0.1", port=0)
    http = start_http_server(service.ctx, host="127.0.0.1", port=0)
    ports.send((server.port, http.port))
    stop.wait()
    http.stop(grace_s=1.0)
    server.stop(grace_s=None)
    service.close()


def bench(
    turns: int, max_new: int, data_dir: Path, *, think_s: float = 0.05, seed: int = 3
) -> dict[str, Any]:
    mp = multiprocessing.get_context("spawn")
    parent_end, child_end = mp.Pipe()
    stop = mp.Event()
    child = mp.Process(target=_serve, args=(data_dir, child_end, stop), daemon=True)
    child.start()
    if not parent_end.poll(300):
        raise SystemExit("the server process did not start")
    grpc_port, http_port = parent_end.recv()
    base = f"http://127.0.0.1:{http_port}/v1"
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stubs = load_stubs()
    codec = BpeCodec(repo_root() / "checkpoints" / MODEL / "tokenizer.json")
    bare = httpx.Client(timeout=300)
    official = openai.OpenAI(base_url=base, api_key=TOKENS["openai"], max_retries=0, timeout=300)
    answers: dict[str, list[int]] = {}
    template = ChatTemplate(encode=codec.encode, generated_ids=lambda text: answers.get(text))
    rows = []
    try:
        created = stubs.sessions_grpc.SessionsStub(channel).CreateSession(
            stubs.sessions.CreateSessionRequest(model=MODEL),
            metadata=(("authorization", f"Bearer {TOKENS['grpc']}"),),
        )
        sid = created.session.session_id
        messages: list[dict[str, str]] = []
        history: list[int] = []
        for k, new in enumerate(_conversation(turns, seed)):
            messages += new
            ids = template.render([ChatMessage(role=m["role"], content=m["content"]) for m in messages])
            assert ids[: len(history)] == history, (
                f"turn {k}: the rendered prompt does not extend the session"
            )
            body = {
                "model": MODEL,
                "messages": list(messages),
                "max_tokens": max_new,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            time.sleep(think_s)
            g = _grpc_turn(stubs, channel, sid, ids[len(history) :], max_new)
            time.sleep(think_s)
            h = _sse_turn(bare, f"{base}/chat/completions", TOKENS["http"], body)
            time.sleep(think_s)
            kd = _sse_turn(
                bare, f"{base}/chat/completions", TOKENS["keyed"], body | {"prompt_cache_key": "agent"}
            )
            time.sleep(think_s)
            oa = _openai_turn(official, body)
            content = [i for i in g["out"] if i != END]
            answer = codec.decode(content)
            for name, r in (("http", h), ("http_keyed", kd), ("http_openai", oa)):
                if r["text"] != answer:
                    raise SystemExit(f"turn {k}: {name} answered {r['text']!r}, gRPC {answer!r}")
            answers[answer] = content
            history = ids + g["out"]
            messages.append({"role": "assistant", "content": answer})
            rows.append(
                {"turn": k, "grpc": _row(g), "http": _row(h), "http_keyed": _row(kd), "http_openai": _row(oa)}
            )
    finally:
        channel.close()
        bare.close()
        stop.set()
        child.join(30)
    later = rows[1:]

    def p50(api: str, field: str) -> float:
        return statistics.median(r[api][field] for r in later)

    def share(api: str) -> float:
        return sum(r[api]["path"] == "FULL_HIT" for r in later) / len(later)

    summary: dict[str, Any] = {
        "http_overhead_ms_p50": p50("http", "overhead_ms"),
        "grpc_overhead_ms_p50": p50("grpc", "overhead_ms"),
        "http_keyed_overhead_ms_p50": p50("http_keyed", "overhead_ms"),
        "http_openai_overhead_ms_p50": p50("http_openai", "overhead_ms"),
        "http_full_hit_share": share("http"),
        "grpc_full_hit_share": share("grpc"),
        "http_keyed_full_hit_share": share("http_keyed"),
        "http_cached_share_mean": statistics.mean(r["http"]["cached_share"] for r in later),
        "grpc_cached_share_mean": statistics.mean(r["grpc"]["cached_share"] for r in later),
        "http_client_ttft_ms_p50": p50("http", "client_ttft_ms"),
        "grpc_client_ttft_ms_p50": p50("grpc", "client_ttft_ms"),
        "http_engine_ttft_ms_p50": p50("http", "engine_ttft_ms"),
        "grpc_engine_ttft_ms_p50": p50("grpc", "engine_ttft_ms"),
    }
    summary["http_over_grpc_overhead_ratio"] = (
        summary["http_overhead_ms_p50"] / summary["grpc_overhead_ms_p50"]
    )
    return {"model": MODEL, "max_new_tokens": max_new, "think_ms": 1e3 * think_s, **summary, "turns": rows}


def _row(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("path", "client_ttft_ms", "engine_ttft_ms", "cached_share", "prompt_tokens")
    return {k: r[k] for k in keep} | {"overhead_ms": r["client_ttft_ms"] - r["engine_ttft_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--think-ms", type=float, default=50.0, help="pause before each request")
    add_json_flag(parser)
    args = parser.parse_args()
    if args.turns < 2:
        parser.error("--turns must be at least 2 (the first turn is cold on both APIs)")
    logs_to_stderr()
    # the served default; the real model refuses a profile that is not in force
    enter_numerics("auto", "benchmarks.bench_http", None)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_http_") as tmp:
        result = bench(args.turns, args.max_new_tokens, Path(tmp), think_s=args.think_ms / 1e3)
    out = table_stream(args.json)
    print(
        f"one {args.turns}-turn agent session, {MODEL}, 1 thread; client TTFT and overhead (client - engine) "
        "in ms:",
        file=out,
    )
    head = f"{'turn':>4s}{'prompt':>7s} | {'gRPC path':>13s}{'ttft':>7s}{'ovh':>6s} | "
    head += f"{'HTTP path':>13s}{'ttft':>7s}{'ovh':>6s}{'cached':>7s} | {'keyed':>7s}{'ovh':>6s} | "
    head += f"{'openai':>7s}{'ovh':>6s}"
    print(head, file=out)
    for r in result["turns"]:
        g, h, kd, oa = r["grpc"], r["http"], r["http_keyed"], r["http_openai"]
        print(
            f"{r['turn']:4d}{h['prompt_tokens']:7d} | {g['path']:>13s}{g['client_ttft_ms']:7.1f}"
            f"{g['overhead_ms']:6.1f} | {h['path']:>13s}{h['client_ttft_ms']:7.1f}{h['overhead_ms']:6.1f}"
            f"{h['cached_share']:7.2f} | {kd['client_ttft_ms']:7.1f}{kd['overhead_ms']:6.1f} | "
            f"{oa['client_ttft_ms']:7.1f}{oa['overhead_ms']:6.1f}",
            file=out,
        )
    print(
        f"overhead p50 over turns 1..: HTTP {result['http_overhead_ms_p50']:.1f} ms, gRPC "
        f"{result['grpc_overhead_ms_p50']:.1f} ms, ratio {result['http_over_grpc_overhead_ratio']:.2f} "
        f"(target <= 1.5); with a key {result['http_keyed_overhead_ms_p50']:.1f} ms; through the openai "
        f"client {result['http_openai_overhead_ms_p50']:.1f} ms",
        file=out,
    )
    print(
        f"full-hit share HTTP {result['http_full_hit_share']:.2f} (gRPC {result['grpc_full_hit_share']:.2f});"
        f" cached share HTTP {result['http_cached_share_mean']:.2f} / gRPC "
        f"{result['grpc_cached_share_mean']:.2f}",
        file=out,
    )
    write_json(
        {
            **result,
            "numerics": numerics_record(),
            "threads": 1,
            "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        },
        args.json,
    )


if __name__ == "__main__":
    main()
