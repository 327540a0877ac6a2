"""Long-history benchmark: the service's own cost of a turn as one session's history grows, with the model
replaced by the labelled NO-OP STAND-IN of `bench_service` (chunks and pool entries of the real model's
byte sizes, so every store write, registry row and pool put is real), so that what grows is the
service's work (registry links and reads, chunk-chain lookups, digests), not the model's.

Run: `python -m benchmarks.bench_long_history [--histories 1000,16000,64000] [--turns 20] [--json PATH|-]`.

One session over loopback gRPC against a node with a SQLite registry file and a RocksDB store in a temp
dir. The history grows with turns of at most 4096 new tokens (4 generated each) up to each size in turn;
there `--turns` turns of 64 new tokens and 4 generated are measured: the median and p90 client latency of
a whole turn (request to the stats event) and the process's CPU time per measured turn (server, the
in-process client and gRPC's threads). The baseline is the same session's figures at the first
(smallest) history, in the same run: `p50_vs_first` is each size's p50 over that one.
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

from benchmarks.bench_service import noop_node
from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, counts_arg, logs_to_stderr, table_stream, write_json

GROW_TOKENS, TURN_TOKENS, GENERATED = 4096, 64, 4


def run(root: Path, histories: list[int], turns: int) -> list[dict[str, Any]]:
    """Each size's measured turns, in ascending order of `histories`."""
    served = noop_node(root, 8)
    client = served.client
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    try:
        sid = client.create()
        n = 0
        for target in histories:
            while n < target:
                grow = min(GROW_TOKENS, target - n)
                client.turn(sid, [rng.randrange(16, 512) for _ in range(grow)], max_new=GENERATED)
                n += grow + GENERATED
            samples, paths = [], set()
            cpu0 = time.process_time()
            for _ in range(turns):
                path, _, elapsed = client.turn(
                    sid, [rng.randrange(16, 512) for _ in range(TURN_TOKENS)], max_new=GENERATED
                )
                samples.append(elapsed)
                paths.add(path)
            cpu_ms = (time.process_time() - cpu0) / turns * 1e3
            rows.append(
                {
                    "history_tokens": n,
                    "turns": turns,
                    "paths": sorted(paths),
                    "p50_ms": statistics.median(samples) * 1e3,
                    "p90_ms": statistics.quantiles(samples, n=10, method="inclusive")[8] * 1e3,
                    "cpu_ms_per_turn": cpu_ms,
                }
            )
            n += turns * (TURN_TOKENS + GENERATED)
    finally:
        served.close()
    first = rows[0]["p50_ms"]
    for row in rows:
        row["p50_vs_first"] = row["p50_ms"] / first
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument(
        "--histories", default="1000,16000,64000", help="history sizes in tokens, comma-separated"
    )
    parser.add_argument("--turns", type=int, default=20, help="measured turns at each size (>= 2)")
    args = parser.parse_args(argv)
    histories = sorted(counts_arg(parser, "--histories", args.histories))
    if args.turns < 2:
        parser.error(f"--turns={args.turns} must be >= 2 (a p90 needs two turns)")
    logs_to_stderr()
    enter_numerics("auto", "benchmarks.bench_long_history", argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvresume-long-history-") as tmp:
        rows = run(Path(tmp), histories, args.turns)
    doc = {"sizes": rows, "cpu": cpu_model(), "threads": 1, "numerics": numerics_record()}
    out = table_stream(args.json)
    print(f"one session's turn as its history grows (model = NO-OP STAND-IN); {cpu_model()}", file=out)
    print(f"{'history':>8} {'turns':>6} {'p50 ms':>8} {'p90 ms':>8} {'cpu ms':>7} {'p50/first':>9}", file=out)
    for r in rows:
        print(
            f"{r['history_tokens']:>8d} {r['turns']:>6d} {r['p50_ms']:>8.2f} {r['p90_ms']:>8.2f} "
            f"{r['cpu_ms_per_turn']:>7.2f} {r['p50_vs_first']:>9.2f}",
            file=out,
        )
    write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
