"""A turn's registry reads on SQLite as the history grows: `TurnReads` in one statement (`_ONE`: one row,
the history aggregated in SQL) against its twin and former path, four statements between a BEGIN and a
ROLLBACK (one row per turn of the history and per span), side by side in one process.

Run: `python -m benchmarks.bench_turn_reads [--turns 10,100,1000] [--reads 200] [--contenders 4]
[--json PATH|-]`.

One session per size with that many turns of 64 new tokens and 4 generated (1000 turns: a 68K-token
history), its tenant's policy, and a segment link per 256 tokens. Each read is the one a turn of the
session's own model makes. The arms alternate read by read, so that the machine's drift meets both; the
first tenth of the reads warm up. Reported per size: the median wall time of a read in each arm, alone
and while `--contenders` threads run short Python bursts that let go of the GIL between them (as the
service's many turn threads do); and the sqlite3 rows each read fetches. Why the second figure: Python
3.11's sqlite3 lets go of the GIL around each step and each column of each fetched row, and where other
threads wait for the GIL each of those hands it to another thread, which the read then waits to get back.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.hardware import cpu_model
from benchmarks.report import add_json_flag, counts_arg, table_stream, write_json
from orchestrator.db import (
    DurableSegment,
    PolicyRepository,
    SegmentRepository,
    SessionRepository,
    TenantRepository,
    TurnReads,
    TurnRepository,
    make_engine,
    make_session_factory,
    run_serializable,
    serializable_factory,
    upgrade,
)
from orchestrator.db.repositories.turns import TurnTimings

NEW_TOKENS, GENERATED, CHUNK = 64, 4, 256
ARMS = ("one_statement", "four_statements")
_EXPIRES = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 1 << 17) for _ in range(n)]


def _read(reads: TurnReads, sid: str) -> Any:
    """The read a turn of the session's own model makes."""
    return reads.read(sid, tenant_id="bench", default_floor_s=0.0, default_ceiling_s=60.0)


def _session(factory: Any, turns: int, rng: random.Random) -> str:
    """A session of `turns` finished turns and a segment link per `CHUNK` tokens of its history."""

    def build(s: Any) -> str:
        row = SessionRepository(s).create(tenant_id="bench", model="m", retention_s=60)
        repo = TurnRepository(s)
        for _ in range(turns):
            turn = repo.begin(row, model="m", input_tokens=_ids(rng, NEW_TOKENS))
            repo.finish(turn, row, output_tokens=_ids(rng, GENERATED), timings=TurnTimings(ttft_s=0.01))
        history = turns * (NEW_TOKENS + GENERATED)
        segments = [
            DurableSegment(
                store_key=f"{row.id}:{start}".encode(), tenant_id="bench", model="m", fingerprint="fp",
                start_pos=start, end_pos=min(start + CHUNK, history), nbytes=CHUNK * 890,
                expires_at=_EXPIRES, node="n", region="r", numerics="portable",
            )
            for start in range(0, history, CHUNK)
        ]  # fmt: skip
        SegmentRepository(s).link_current(row.id, "fp", segments)
        return row.id

    return run_serializable(factory, build)


class _Contenders:
    """Threads that run short pure-Python bursts and let go of the GIL between them."""

    def __init__(self, n: int) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        while not self._stop.is_set():
            sum(i * i for i in range(300))  # about 20-40 us of Python holding the GIL
            time.sleep(0.0001)

    def __enter__(self) -> _Contenders:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def _read_ms(reads: dict[str, TurnReads], sid: str, n: int) -> dict[str, float]:
    """Each arm's median ms a read over `n` reads, the arms alternating read by read."""
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(n):
        for arm in ARMS if i % 2 == 0 else reversed(ARMS):
            t0 = time.perf_counter()
            got = _read(reads[arm], sid)
            elapsed = time.perf_counter() - t0
            if got is None or got.row is None:
                raise RuntimeError(f"the {arm} read found no session {sid}")
            if i >= n // 10:
                times[arm].append(elapsed)
    return {arm: statistics.median(t) * 1e3 for arm, t in times.items()}


def measure(root: Path, sizes: list[int], n_reads: int, contenders: int) -> list[dict[str, Any]]:
    url = f"sqlite:///{root / 'registry.sqlite3'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        writer = serializable_factory(engine)
        run_serializable(writer, lambda s: TenantRepository(s).ensure("bench"))
        run_serializable(
            writer,
            lambda s: PolicyRepository(s).set("bench", floor_s=1.0, ceiling_s=3600.0, allowed_regions=["r"]),
        )
        sessions = make_session_factory(engine)
        reads = {
            "one_statement": TurnReads(sessions),
            "four_statements": TurnReads(sessions, one_statement=False),
        }
        rng = random.Random(0)
        rows = []
        for turns in sizes:
            sid = _session(writer, turns, rng)
            snap = _read(reads["one_statement"], sid)
            if snap != _read(reads["four_statements"], sid):
                raise RuntimeError(f"the two reads differ at {turns} turns: refusing to time them")
            alone = _read_ms(reads, sid, n_reads)
            with _Contenders(contenders):
                contended = _read_ms(reads, sid, n_reads)
            rows.append(
                {
                    "turns": turns,
                    "history_tokens": len(snap.history),
                    "spans": len(snap.spans),
                    # facts, history, policy and spans rows against the one row
                    "rows_fetched": {"one_statement": 1, "four_statements": 2 + turns + len(snap.spans)},
                    "alone_ms": alone,
                    "contended_ms": contended,
                    "ratio_alone": alone["four_statements"] / alone["one_statement"],
                    "ratio_contended": contended["four_statements"] / contended["one_statement"],
                }
            )
        return rows
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--turns", default="10,100,1000", help="turns of history, comma-separated")
    parser.add_argument("--reads", type=int, default=200, help="reads per arm, size and setting (>= 2)")
    parser.add_argument("--contenders", type=int, default=4, help="threads contending for the GIL (>= 1)")
    args = parser.parse_args(argv)
    sizes = counts_arg(parser, "--turns", args.turns)
    if args.reads < 2:
        parser.error(f"--reads={args.reads} must be >= 2")
    if args.contenders < 1:
        parser.error(f"--contenders={args.contenders} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="kvresume-reads-") as tmp:
        rows = measure(Path(tmp), sizes, args.reads, args.contenders)
    out = table_stream(args.json)
    print(
        f"a turn's registry reads (SQLite), median ms a read, arms alternating; "
        f"{cpu_model()}, {os.cpu_count()} CPUs; {args.contenders} contending threads",
        file=out,
    )
    print(
        f"{'turns':>6} {'tokens':>7} {'rows 1/4':>9} {'alone 1':>8} {'alone 4':>8} {'ratio':>6} "
        f"{'contended 1':>11} {'contended 4':>11} {'ratio':>6}",
        file=out,
    )
    for r in rows:
        a, c, f = r["alone_ms"], r["contended_ms"], r["rows_fetched"]
        print(
            f"{r['turns']:>6d} {r['history_tokens']:>7d} {f['one_statement']:>4d}/{f['four_statements']:<4d} "
            f"{a['one_statement']:>8.3f} {a['four_statements']:>8.3f} {r['ratio_alone']:>6.2f} "
            f"{c['one_statement']:>11.3f} {c['four_statements']:>11.3f} {r['ratio_contended']:>6.2f}",
            file=out,
        )
    write_json(
        {
            "benchmark": "bench_turn_reads",
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "reads": args.reads,
            "contenders": args.contenders,
            "sizes": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
