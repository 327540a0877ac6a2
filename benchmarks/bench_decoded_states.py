"""Decoded global KV kept beside pool entries (orchestrator/engine/decoded_states.py): full-hit TTFT of
one session at long histories with the cache on against the same turns with it off (budget 0: the
chunks are imported and dequantized on every full hit, the slow twin), over real gRPC with the trained
v41-sib-s, a SQLite registry and RocksDB stores.

Two nodes in this process serve the same session turn for turn: the history is built from turns of
`--build-tokens` new tokens; at each length of `--lengths` both nodes run `--repeats` full-hit turns of
`--probe-tokens` new tokens (alternating which node goes first), each generating one token. TTFT is the
engine's (stats.ttft_s: preparation, which reads, verifies and either fills or imports the stored chunks,
then the prefill of the new tokens); `reuse_*` time `find_reuse` alone on the cache-on node: served
unread (the default: the chunks proven without reading them), kept after reading every chunk ("on"),
and importing ("off"). Refuses to report unless every turn after the first is a FULL_HIT on
both nodes with the same tokens, and the cache-on node's full hits were served from kept state.

With `--model-process separate` both nodes run the model in a process of their own, which keeps the
decoded state (`RemoteKept` handles in the node's process) and runs `find_reuse`'s fill or import there.

Run: python -m benchmarks.bench_decoded_states [--lengths 2048,4096,8192] [--repeats 5]
[--model-process inline|separate] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from orchestrator.api import build_server
from orchestrator.db import SessionRepository
from orchestrator.engine import ModelRegistry, ServedModelSpec, build_node, repo_root
from orchestrator.engine.prefix_reuse import find_reuse
from orchestrator.settings import Settings

MODEL = "v41-sib-s"
TOKEN = "tok-bench"


class _Node:
    def __init__(self, data_dir: Path, registry: ModelRegistry, budget: int, model_process: str) -> None:
        data_dir.mkdir(parents=True)
        settings = Settings(
            data_dir=data_dir,
            database_url=f"sqlite:///{data_dir / 'registry.sqlite3'}",
            tenant_tokens={"bench": TOKEN},
            admin_token="tok-admin",
            grpc_port=0,
            metrics_enabled=False,
            region="eu-1",
            decoded_state_budget_bytes=budget,
            model_process=model_process,
        )
        self.service = build_node(settings, registry=registry)
        self.server = build_server(self.service.ctx, host="127.0.0.1", port=0)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stubs = self.service.ctx.stubs
        self._md = (("authorization", f"Bearer {TOKEN}"),)
        got = self.stubs.sessions_grpc.SessionsStub(self.channel).CreateSession(
            self.stubs.sessions.CreateSessionRequest(model=MODEL), metadata=self._md
        )
        self.session = got.session.session_id

    def turn(self, ids: list[int], max_new: int) -> tuple[str, float, list[int]]:
        pb = self.stubs
        request = pb.sessions.TurnRequest(
            session_id=self.session,
            tokens=pb.sessions.TokenIds(ids=ids),
            generation=pb.sessions.GenerationParams(max_new_tokens=max_new),
        )
        plan = stats = None
        out: list[int] = []
        for event in pb.sessions_grpc.SessionsStub(self.channel).Turn(request, metadata=self._md):
            kind = event.WhichOneof("event")
            if kind == "plan":
                plan = event.plan
            elif kind == "tokens":
                out += list(event.tokens.ids)
            else:
                stats = event.stats
        assert plan is not None and stats is not None
        return pb.common.ResumePath.Name(plan.path).removeprefix("RESUME_PATH_"), stats.ttft_s, out

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace_s=None)
        self.service.close()


def _time_reuse(node: _Node, n: int, repeats: int) -> tuple[list[float], list[float], list[float]]:
    """Seconds of `find_reuse` (read, verify, fill or import, windows import) for the session's next
    turn on the cache-on node: with its kept state served unread (the engine's default: the chunks proven
    from the index, the registry and kept digests), with its kept state after reading and verifying every
    chunk, and without (None: the import), in rotating order."""
    engine = node.service.engine
    served = engine.registry.get(MODEL)
    with node.service.ctx.sessions() as s:
        history = SessionRepository(s).history(node.session)
    assert len(history) == n, (len(history), n)

    def once(decoded, unread: bool = False) -> tuple[float, Any]:
        started = time.perf_counter()
        got = find_reuse(
            engine.store,
            engine.pool,
            node.service.ctx.sessions,
            engine.compute,
            tenant="bench",
            session_id=node.session,
            served=served,
            history=history,
            new_tokens=[17],
            last_model=MODEL,
            decoded=decoded,
            digests=engine._prep.digests if unread else None,
            kept_state_skips_reads=unread,
        )
        return time.perf_counter() - started, got

    times: dict[str, list[float]] = {"unread": [], "on": [], "off": []}
    kinds = list(times)
    for r in range(repeats):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            took, got = once(None if kind == "off" else engine.decoded, unread=kind == "unread")
            assert got.pooled_prefix is not None and got.pooled_prefix.decoded == (kind != "off")
            assert got.pooled_prefix.payloads_read == (kind != "unread")
            times[kind].append(took)
    return times["unread"], times["on"], times["off"]


def bench(
    lengths: list[int],
    repeats: int,
    build_tokens: int,
    probe_tokens: int,
    data_dir: Path,
    model_process: str = "inline",
) -> dict:
    registry = ModelRegistry(
        {MODEL: ServedModelSpec(name=MODEL, checkpoint=repo_root() / "checkpoints" / MODEL)}
    )
    on = _Node(data_dir / "on", registry, 256 << 20, model_process)
    off = _Node(data_dir / "off", registry, 0, model_process)
    rng = random.Random(0)
    history = 0
    turns = 0
    rows: list[dict[str, Any]] = []

    def both(ids: list[int], max_new: int, first_on: bool) -> tuple[float, float]:
        nonlocal history, turns
        order = [on, off] if first_on else [off, on]
        got = {id(n): n.turn(ids, max_new) for n in order}
        (p_on, t_on, o_on), (p_off, t_off, o_off) = got[id(on)], got[id(off)]
        if turns and not (p_on == p_off == "FULL_HIT"):
            raise SystemExit(f"turn {turns}: paths {p_on} (on) / {p_off} (off), expected FULL_HIT")
        if o_on != o_off:
            raise SystemExit(f"turn {turns}: tokens differ, {o_on} (on) vs {o_off} (off)")
        history += len(ids) + len(o_on)
        turns += 1
        return t_on, t_off

    try:
        for target in lengths:
            while history < target - probe_tokens:
                # each turn adds its new tokens and the one it generates
                n = max(1, min(build_tokens, target - history - 1))
                both([rng.randrange(16, 4096) for _ in range(n)], 1, True)
            hits_before = on.service.engine.decoded.stats().hits
            t_on: list[float] = []
            t_off: list[float] = []
            at = history
            for r in range(repeats):
                a, b = both([rng.randrange(16, 4096) for _ in range(probe_tokens)], 1, r % 2 == 0)
                t_on.append(a)
                t_off.append(b)
            hits = on.service.engine.decoded.stats().hits - hits_before
            if hits != repeats:
                raise SystemExit(f"at {at} tokens: {hits} of {repeats} full hits served from kept state")
            kept = on.service.engine.decoded.stats().bytes_used
            reuse_unread, reuse_on, reuse_off = _time_reuse(on, history, repeats)
            rows.append(
                {
                    "history_tokens": at,
                    "ttft_on_ms": round(1e3 * statistics.median(t_on), 3),
                    "ttft_off_ms": round(1e3 * statistics.median(t_off), 3),
                    "ttft_off_over_on": round(statistics.median(t_off) / statistics.median(t_on), 3),
                    "reuse_on_ms": round(1e3 * statistics.median(reuse_on), 3),
                    "reuse_off_ms": round(1e3 * statistics.median(reuse_off), 3),
                    "reuse_off_over_on": round(statistics.median(reuse_off) / statistics.median(reuse_on), 3),
                    "reuse_unread_ms": round(1e3 * statistics.median(reuse_unread), 3),
                    "reuse_on_over_unread": round(
                        statistics.median(reuse_on) / statistics.median(reuse_unread), 3
                    ),
                    "kept_bytes": kept,
                    "ttft_on_s": [round(x, 5) for x in t_on],
                    "ttft_off_s": [round(x, 5) for x in t_off],
                }
            )
    finally:
        on.close()
        off.close()
    return {"model": MODEL, "model_process": model_process, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192", help="history lengths to measure at")
    parser.add_argument("--repeats", type=int, default=5, help="full-hit turns per node at each length")
    parser.add_argument("--build-tokens", type=int, default=512, help="new tokens per history-building turn")
    parser.add_argument("--probe-tokens", type=int, default=8, help="new tokens per measured turn")
    parser.add_argument(
        "--model-process",
        choices=("inline", "separate"),
        default="inline",
        help="where both nodes run the model (separate: a model process each, which keeps the state)",
    )
    add_json_flag(parser)
    args = parser.parse_args()
    logs_to_stderr()
    # the served default; the real model refuses a profile that is not in force
    enter_numerics("auto", "benchmarks.bench_decoded_states", None)
    torch.set_num_threads(1)
    lengths = sorted(int(x) for x in args.lengths.split(",") if x)
    with tempfile.TemporaryDirectory(prefix="bench_decoded_states_") as tmp:
        doc = bench(
            lengths, args.repeats, args.build_tokens, args.probe_tokens, Path(tmp), args.model_process
        )
    out = table_stream(args.json)
    print(
        f"decoded states, {MODEL}, model {args.model_process}, "
        f"full-hit TTFT (engine, median of {args.repeats}), 1 thread, "
        f"{cpu_model()}, numerics {numerics_record()['cpu_path']}:",
        file=out,
    )
    print(
        f"{'history':>8s}{'TTFT on':>10s}{'off ms':>10s}{'off/on':>8s}"
        f"{'reuse on':>10s}{'off ms':>10s}{'off/on':>8s}{'unread':>8s}{'on/unread':>10s}{'kept MiB':>10s}",
        file=out,
    )
    for r in doc["rows"]:
        print(
            f"{r['history_tokens']:8d}{r['ttft_on_ms']:10.1f}{r['ttft_off_ms']:10.1f}"
            f"{r['ttft_off_over_on']:8.2f}{r['reuse_on_ms']:10.1f}{r['reuse_off_ms']:10.1f}"
            f"{r['reuse_off_over_on']:8.2f}{r['reuse_unread_ms']:8.1f}{r['reuse_on_over_unread']:10.2f}"
            f"{r['kept_bytes'] / 2**20:10.2f}",
            file=out,
        )
    write_json(
        doc
        | {
            "numerics": numerics_record(),
            "cpu": cpu_model(),
            "machine": platform.machine(),
            "threads": 1,
            "repeats": args.repeats,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
