"""Long-session benchmark: what a turn costs as an agent session grows, with a full hit served from the
session's kept decoded state without reading its stored chunks (the default) against the same turns on
a node that reads and verifies every stored chunk each turn (`kept_state_skips_reads = False`, the
twin), side by side in one process.

Run: `python -m benchmarks.bench_long_session [--turns 300] [--model v41-tiny] [--json PATH|-]`.

Each node serves one session over loopback gRPC with a SQLite registry file and a RocksDB store in a
temp dir, running the real seeded random-init model (torch CPU, 1 thread, the served numerics profile):
a first prompt of 256 tokens, then turns of 64 new tokens and 4 generated. The two nodes take the same
turns alternately, so drift of the machine's speed reaches both alike. Reported per window of turns
(the first 20, 20 around the middle, the last 20): the median client latency of a whole turn (request
to the stats event), the median engine time to first token and the median time of the turn's
preparation (registry reads, the stored prefix, the pooled windows, the plan: where the reads are), on
each node, and their ratios. The run refuses to report when the two nodes' tokens or stored chunk bytes
differ.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_service import TENANT, _Client, _settings
from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from orchestrator.api import build_server
from orchestrator.engine import ModelRegistry, ServedModelSpec, build_node

FIRST_TOKENS, TURN_TOKENS, GENERATED = 256, 64, 4
NODES = ("unread", "reads")


class _Served:
    """One node with its gRPC server, client and session."""

    def __init__(self, root: Path, registry: ModelRegistry, *, skips_reads: bool) -> None:
        self.node = build_node(_settings(root, 4), registry=registry, preload=True)
        prep = self.node.engine._prep
        prep.kept_state_skips_reads = skips_reads
        # the turn's preparation (registry reads, the stored prefix, the pooled windows, the plan) timed
        # apart: the part of the turn that reading the stored chunks adds to
        self.prepare_s: list[float] = []
        untimed = prep.prepare

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return untimed(*args, **kwargs)
            finally:
                self.prepare_s.append(time.perf_counter() - t0)

        prep.prepare = timed  # type: ignore[method-assign]
        self.server = build_server(self.node.ctx, host="127.0.0.1", port=0)
        self.client = _Client(self.node, self.server.port)
        self.session = self.client.create()
        self.rows: list[dict[str, Any]] = []

    def turn(self, ids: list[int]) -> list[int]:
        path, stats, elapsed = self.client.turn(self.session, ids, max_new=GENERATED)
        prepare_ms = self.prepare_s[-1] * 1e3 if self.prepare_s else float("nan")
        self.rows.append(
            {
                "path": path,
                "client_ms": elapsed * 1e3,
                "ttft_ms": stats.ttft_s * 1e3,
                "prepare_ms": prepare_ms,
            }
        )
        return self._last_tokens()

    def _last_tokens(self) -> list[int]:
        from orchestrator.db import TurnRepository
        from orchestrator.db.models import blob_to_tokens

        with self.node.ctx.sessions() as s:
            return blob_to_tokens(TurnRepository(s).list(self.session)[-1].output_tokens)

    def stored(self, fingerprint: str, history: list[int]) -> list[bytes]:
        return self.node.store.longest_valid_prefix(TENANT, fingerprint, history).payloads

    def close(self) -> None:
        self.client.channel.close()
        self.server.stop(grace_s=None)
        self.node.close()


def _windows(n_turns: int) -> list[tuple[int, int]]:
    mid = n_turns // 2
    spans = [
        (1, min(21, n_turns)),
        (max(1, mid - 10), min(n_turns, mid + 10)),
        (max(1, n_turns - 20), n_turns),
    ]
    return list(dict.fromkeys(spans))


def run(root: Path, n_turns: int, model: str) -> dict[str, Any]:
    registry = ModelRegistry({"m": ServedModelSpec(name="m", config=model, seed=1)})
    served = registry.get("m")
    assert served is not None
    nodes = {name: _Served(root / name, registry, skips_reads=name == "unread") for name in NODES}
    rng = random.Random(0)
    history: list[int] = []
    try:
        for i in range(n_turns + 1):
            ids = [rng.randrange(16, 512) for _ in range(FIRST_TOKENS if i == 0 else TURN_TOKENS)]
            got = {name: node.turn(ids) for name, node in nodes.items()}
            if got["unread"] != got["reads"]:
                raise SystemExit(f"turn {i}: tokens differ between the nodes: {got}")
            history += ids + got["unread"]
        stored = {name: node.stored(served.fingerprint_hex, history) for name, node in nodes.items()}
        if not stored["unread"] or stored["unread"] != stored["reads"]:
            raise SystemExit("the two nodes' stored chunks differ")
        unread = nodes["unread"].node.store.stats()
        reads = nodes["reads"].node.store.stats()
        paths = [r["path"] for r in nodes["unread"].rows[1:]]
        windows = []
        for a, b in _windows(n_turns):
            row: dict[str, Any] = {"turns": f"{a}-{b - 1}", "history_tokens_at_end": None}
            for name, node in nodes.items():
                part = node.rows[a:b]
                row[f"{name}_client_ms"] = statistics.median(r["client_ms"] for r in part)
                row[f"{name}_ttft_ms"] = statistics.median(r["ttft_ms"] for r in part)
                row[f"{name}_prepare_ms"] = statistics.median(r["prepare_ms"] for r in part)
            row["history_tokens_at_end"] = FIRST_TOKENS + GENERATED + (b - 1) * (TURN_TOKENS + GENERATED)
            row["client_ratio"] = row["reads_client_ms"] / row["unread_client_ms"]
            row["ttft_ratio"] = row["reads_ttft_ms"] / row["unread_ttft_ms"]
            row["prepare_ratio"] = row["reads_prepare_ms"] / row["unread_prepare_ms"]
            windows.append(row)
        return {
            "model": model,
            "turns": n_turns,
            "history_tokens": len(history),
            "stored_bytes_per_token": sum(len(p) for p in stored["unread"]) / len(history),
            "full_hits": paths.count("FULL_HIT"),
            "unread_chunk_hits": unread.unread_chunk_hits,
            "reads_unread_chunk_hits": reads.unread_chunk_hits,
            "windows": windows,
        }
    finally:
        for node in nodes.values():
            node.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--turns", type=int, default=300, help="turns after the first (>= 2)")
    parser.add_argument("--model", default="v41-tiny", help="preset of the seeded random-init model")
    args = parser.parse_args(argv)
    if args.turns < 2:
        parser.error(f"--turns={args.turns} must be >= 2")
    logs_to_stderr()
    enter_numerics("auto", "benchmarks.bench_long_session", argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvresume-long-") as tmp:
        result = run(Path(tmp), args.turns, args.model)
    doc = {**result, "cpu": cpu_model(), "threads": 1, "numerics": numerics_record()}
    out = table_stream(args.json)
    print(
        f"long session, {args.model} (seeded random init), {result['history_tokens']} tokens after "
        f"{args.turns} turns, {result['stored_bytes_per_token']:.0f} stored B/token; {cpu_model()}, 1 thread",
        file=out,
    )
    print(
        f"full hits {result['full_hits']}/{args.turns}; chunks served unread "
        f"{result['unread_chunk_hits']} (twin: {result['reads_unread_chunk_hits']})",
        file=out,
    )
    head = f"{'turns':>9} {'tokens':>7}"
    for what in ("client", "ttft", "prepare"):
        head += f" | {what + ' ms unread':>17} {'reads':>7} {'ratio':>6}"
    print(head, file=out)
    for w in result["windows"]:
        line = f"{w['turns']:>9} {w['history_tokens_at_end']:>7}"
        for what in ("client", "ttft", "prepare"):
            line += (
                f" | {w[f'unread_{what}_ms']:>17.2f} {w[f'reads_{what}_ms']:>7.2f} {w[f'{what}_ratio']:>6.2f}"
            )
        print(line, file=out)
    write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
