"""Registry links of a long session: `SegmentRepository.link_current` from the session's links (the path
from `link_sqlite.INCREMENTAL_FROM` segments on) against the upsert of every segment (the path below it),
side by side in one process, on SQLite and, when given one, PostgreSQL.

Run: `python -m benchmarks.bench_link_current [--segments 4,16,64,250] [--calls 40] [--postgres URL]
[--json PATH|-]`.

Each turn of a session links the chunks of its whole history (every one gets the turn's expiry) and
supersedes its last tail; at 250 chunks of 256 tokens (a 64K-token history) the upsert of every chunk
re-sent 250 rows a turn inside the write transaction every other turn waits for. Here one session per arm
and size links N full chunks plus a tail that changes each call, with an expiry that moves up each call
(so the linked rows are really extended), in its own serialisable transaction, the two arms alternating
call by call so that the machine's drift meets both; the first tenth of the calls warm up. Reported per
backend and size: the median wall time of a call, each arm, and the ratio (upsert of every segment over
the incremental path). PostgreSQL runs in a fresh schema of the server at URL (dropped after).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.hardware import cpu_model
from benchmarks.report import add_json_flag, counts_arg, table_stream, write_json
from orchestrator.db import (
    DurableSegment,
    SegmentRepository,
    SessionRepository,
    TenantRepository,
    make_engine,
    run_serializable,
    scratch_schema,
    serializable_factory,
    upgrade,
)
from orchestrator.db.repositories import link_sqlite

CHUNK = 256
_T0 = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)
# the arms: the threshold link_current runs under (the upsert of every segment: never incremental)
ARMS = {"upsert_all": 10**9, "incremental": link_sqlite.INCREMENTAL_FROM}


def _segment(sid: str, k: int, end: int, expires: dt.datetime) -> DurableSegment:
    return DurableSegment(
        store_key=f"{sid}:{k}:{end}".encode(), tenant_id="bench", model="m", fingerprint="fp",
        start_pos=CHUNK * k, end_pos=end, nbytes=CHUNK * 890, expires_at=expires, node="n", region="r",
        numerics="portable",
    )  # fmt: skip


def _one_call(factory: Any, sid: str, n: int, i: int, threshold: int) -> float:
    """Seconds of call `i` of a session of `n` full chunks: its tail superseded, its expiry moved up."""
    expires = _T0 + dt.timedelta(seconds=i)
    segs = [_segment(sid, k, CHUNK * (k + 1), expires) for k in range(n)]
    segs.append(_segment(sid, n, CHUNK * n + 1 + i, expires))
    link_sqlite.INCREMENTAL_FROM = threshold
    try:
        t0 = time.perf_counter()
        run_serializable(factory, lambda s: SegmentRepository(s).link_current(sid, "fp", segs))
        return time.perf_counter() - t0
    finally:
        link_sqlite.INCREMENTAL_FROM = ARMS["incremental"]


def measure(url: str, sizes: list[int], calls: int) -> list[dict[str, Any]]:
    """Per size, each arm's median ms a call and the ratio, on the registry at `url` (migrated here)."""
    upgrade(url)
    engine = make_engine(url)
    factory = serializable_factory(engine)
    rows = []
    try:
        run_serializable(factory, lambda s: TenantRepository(s).ensure("bench"))
        for n in sizes:
            sids = {
                arm: run_serializable(
                    factory,
                    lambda s: SessionRepository(s).create(tenant_id="bench", model="m", retention_s=60).id,
                )
                for arm in ARMS
            }
            times: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for i in range(calls):
                for arm, threshold in ARMS.items():
                    elapsed = _one_call(factory, sids[arm], n, i, threshold)
                    if i >= calls // 10:
                        times[arm].append(elapsed)
            med = {arm: statistics.median(t) * 1e3 for arm, t in times.items()}
            rows.append(
                {
                    "segments": n + 1,
                    "upsert_all_ms": med["upsert_all"],
                    "incremental_ms": med["incremental"],
                    "ratio": med["upsert_all"] / med["incremental"],
                }
            )
    finally:
        engine.dispose()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--segments", default="4,16,64,250", help="full chunks linked, comma-separated")
    parser.add_argument("--calls", type=int, default=40, help="calls per arm and size (>= 2)")
    parser.add_argument("--postgres", default=None, metavar="URL", help="also on this PostgreSQL server")
    args = parser.parse_args(argv)
    sizes = counts_arg(parser, "--segments", args.segments)
    if args.calls < 2:
        parser.error(f"--calls={args.calls} must be >= 2")
    doc: dict[str, Any] = {"cpu": cpu_model(), "calls": args.calls, "backends": {}}
    with tempfile.TemporaryDirectory(prefix="kvresume-link-") as tmp:
        doc["backends"]["sqlite"] = measure(f"sqlite:///{Path(tmp) / 'registry.sqlite3'}", sizes, args.calls)
    if args.postgres:
        with scratch_schema(args.postgres, "kvr_bench_") as url:
            doc["backends"]["postgresql"] = measure(url, sizes, args.calls)
    out = table_stream(args.json)
    print(f"link_current of one session, median ms a call (alternating arms); {cpu_model()}", file=out)
    print(f"{'backend':>10} {'segments':>8} {'upsert all':>10} {'incremental':>11} {'ratio':>6}", file=out)
    for backend, rows in doc["backends"].items():
        for r in rows:
            print(
                f"{backend:>10} {r['segments']:>8d} {r['upsert_all_ms']:>10.2f} {r['incremental_ms']:>11.2f} "
                f"{r['ratio']:>6.2f}",
                file=out,
            )
    write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
