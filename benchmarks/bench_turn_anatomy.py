"""Where one session's no-op turn goes, and what hiding a part of it would give: the one-session sweep of
`bench_service` (thread-pool gRPC server, NO-OP STAND-IN, the same node) taken apart. Knows nothing of
the turn's code beyond the few functions its probes wrap.

Run: `python -m benchmarks.bench_turn_anatomy [--turns 600] [--probe-turns 800] [--json PATH|-]`.

Issue 11's one-session target is a turn's p50 at most 2x `anchor_turn_floor_ms_c1` (a bare gRPC stream of
6 messages, one synced SQLite commit, one synced RocksDB batch of one chunk). This benchmark reports, in one
process, on the node `bench_service` measures:

- the turn's p50 against that floor (measured here, at one client);
- the process's CPU a turn by thread (the gRPC handler that runs the turn, the server's poller, gRPC's
  core threads, the in-process client, and the client's per-call threads, which exit: the process's CPU
  less the live threads'), and context switches a turn (Linux `/proc`);
- SQLite WAL frames a turn (pages the registry transaction writes);
- what-if probes, each in alternating pairs of turns in the same process (so the VM's drift, 10-50%
  within minutes here, moves both arms alike): the p50 with the probe (B) against without it (A).
  A probe changes what the service does, for this measurement only:
  - `store_sync_skipped`: the store's WAL sync not run at all (durability off: the most that hiding the
    sync could give);
  - `store_sync_overlapped`: the sync handed to a helper thread at the put and waited for after the
    registry transaction's statements, before its commit (the store's chunks are visible before the
    sync here, which the service does not allow: timing only);
  - `report_on_thread`: the turn's metrics and canonical log line handed to a helper thread, off the
    stream's end;
  - `switch_interval_0p2ms`: the interpreter's GIL switch interval at 0.2 ms (default 5 ms).
  A probe that gives nothing says that the part it hides is not what the turn waits for: on a 2-vCPU VM
  with one interpreter lock, the turn, the gRPC threads and the in-process client take turns on it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import orchestrator.api.turn_runner as turn_runner
import orchestrator.engine.turn_engine as turn_engine
from benchmarks.bench_service import NoOpNode, noop_node
from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from benchmarks.service_anchors import measure_turn_floor
from storage import GlobalKVStore

# A session's turns before a fresh one: its history stays as short as the one-session sweep's.
TURNS_PER_SESSION = 40
PROBES = ("store_sync_skipped", "store_sync_overlapped", "report_on_thread", "switch_interval_0p2ms")
_FRAME_HEADER_BYTES = 24  # a WAL frame is this header and one database page


class _Toggle:
    """The probe's arm: B (on) for the second turn of every pair, A before it."""

    def __init__(self) -> None:
        self.on = False


@contextlib.contextmanager
def _probe(name: str, toggle: _Toggle) -> Iterator[Callable[[], None]]:
    """Apply probe `name` while `toggle.on`; yields the hook the driver calls before each turn."""
    before_turn: Callable[[], None] = lambda: None  # noqa: E731
    if name == "store_sync_skipped":
        real_sync = GlobalKVStore._sync_wal

        def sync(store: GlobalKVStore, generation: int = 0) -> None:
            if not toggle.on:
                real_sync(store, generation)

        with mock.patch.object(GlobalKVStore, "_sync_wal", sync):
            yield before_turn
    elif name == "store_sync_overlapped":
        helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-wal-sync")
        held = threading.local()
        real_settle = GlobalKVStore._settle_ticket
        real_finish = turn_engine.write_finish

        def settle(store: GlobalKVStore, ticket: Any) -> None:
            if toggle.on and ticket:
                wal, n = ticket
                helper.submit(wal.wait, n)
                held.ticket = ticket
                return
            real_settle(store, ticket)

        def finish(*args: Any, **kwargs: Any) -> None:
            real_finish(*args, **kwargs)
            ticket = getattr(held, "ticket", None)
            if ticket is not None:
                held.ticket = None
                wal, n = ticket
                wal.wait(n)  # the registry commits only after the store's batch is durable

        try:
            with (
                mock.patch.object(GlobalKVStore, "_settle_ticket", settle),
                mock.patch.object(turn_engine, "write_finish", finish),
            ):
                yield before_turn
        finally:
            helper.shutdown(wait=True)
    elif name == "report_on_thread":
        helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-report")
        real_report = turn_runner._report

        def report(*args: Any, **kwargs: Any) -> None:
            if toggle.on:
                helper.submit(real_report, *args, **kwargs)
            else:
                real_report(*args, **kwargs)

        try:
            with mock.patch.object(turn_runner, "_report", report):
                yield before_turn
        finally:
            helper.shutdown(wait=True)
    elif name == "switch_interval_0p2ms":
        default = sys.getswitchinterval()
        try:
            yield lambda: sys.setswitchinterval(0.0002 if toggle.on else default)
        finally:
            sys.setswitchinterval(default)
    else:
        raise ValueError(f"unknown probe {name!r}; known: {', '.join(PROBES)}")


class _Turns:
    """Turns of 64 new tokens and 4 generated on one session at a time, fresh sessions every
    `TURNS_PER_SESSION` turns (each with its cold first turn, not measured)."""

    def __init__(self, node: NoOpNode, seed: int) -> None:
        self._client = node.client
        self._rng = random.Random(seed)
        self._sid = ""
        self._done = TURNS_PER_SESSION

    def _ids(self, n: int) -> list[int]:
        return [self._rng.randrange(16, 512) for _ in range(n)]

    def one(self) -> float:
        """One measured turn's client-side seconds."""
        if self._done == TURNS_PER_SESSION:
            self._sid = self._client.create()
            self._client.turn(self._sid, self._ids(256))
            self._done = 0
        self._done += 1
        path, _, elapsed = self._client.turn(self._sid, self._ids(64))
        if path != "FULL_HIT":
            raise RuntimeError(f"a warm lone turn took {path}, not FULL_HIT: the node is not as measured")
        return elapsed


def _thread_kind(py_name: str | None, comm: str) -> str:
    if py_name is None:
        return "grpc_core" if comm.startswith(("event_engine", "grpc")) else "other_native"
    if py_name.startswith("ThreadPoolExecutor"):
        return "grpc_handler"
    if "(_serve)" in py_name:
        return "grpc_server_poller"
    if py_name == "MainThread":
        return "client"
    return "other_python"


def _cpu_seconds(task: Path, hz: int) -> float:
    """A thread's CPU time: from `schedstat` in nanoseconds where the kernel keeps it, else `stat`'s
    user and system ticks (1/hz s: a few turns' CPU spread over a pool's threads may read 0 ticks)."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (FileNotFoundError, PermissionError, IndexError, ValueError):
        fields = (task / "stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / hz


def _tasks() -> dict[str, tuple[str, float, int]]:
    """Each live thread of this process: (comm, CPU seconds, context switches); {} off Linux."""
    out: dict[str, tuple[str, float, int]] = {}
    root = Path("/proc/self/task")
    if not root.is_dir():
        return out
    hz = os.sysconf("SC_CLK_TCK")
    for task in root.iterdir():
        try:
            cpu = _cpu_seconds(task, hz)
            status = (task / "status").read_text()
            comm = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        switches = sum(int(m) for m in re.findall(r"ctxt_switches:\s+(\d+)", status))
        out[task.name] = (comm, cpu, switches)
    return out


def _wal_frames_per_turn(node: NoOpNode, turns: _Turns, n: int = 10) -> float | None:
    """Pages the registry's WAL gains a turn, over `n` turns after a checkpoint that empties it (None: not
    a SQLite file registry)."""
    database = node.node.ctx.writer.url.database
    db = Path(database) if database else None
    if db is None or not db.is_file():
        return None
    wal = db.with_name(db.name + "-wal")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (page_bytes,) = conn.execute("PRAGMA page_size").fetchone()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    start = wal.stat().st_size if wal.exists() else 0
    for _ in range(n):
        turns.one()
    return (wal.stat().st_size - start) / (page_bytes + _FRAME_HEADER_BYTES) / n


def anatomy(root: Path, n_turns: int) -> dict[str, Any]:
    """The lone turn as served: p50, CPU and switches by thread, WAL frames."""
    node = noop_node(root, 8)
    try:
        turns = _Turns(node, seed=1)
        for _ in range(20):
            turns.one()
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        before, cpu0 = _tasks(), time.process_time()
        samples = [turns.one() for _ in range(n_turns)]
        cpu = time.process_time() - cpu0
        after = _tasks()
        names.update({str(t.native_id): t.name for t in threading.enumerate()})
        by_kind: dict[str, dict[str, float]] = {}
        live_cpu = 0.0
        for tid, (comm, secs, switches) in after.items():
            c0, s0 = before.get(tid, (comm, 0.0, 0))[1:]
            kind = by_kind.setdefault(_thread_kind(names.get(tid), comm), {"cpu_ms": 0.0, "switches": 0.0})
            kind["cpu_ms"] += (secs - c0) * 1e3 / n_turns
            kind["switches"] += (switches - s0) / n_turns
            live_cpu += secs - c0
        if after:
            # the client's per-call threads (grpcio's channel spin) exit within the call
            by_kind["exited_threads"] = {"cpu_ms": max(0.0, cpu - live_cpu) * 1e3 / n_turns, "switches": 0.0}
        return {
            "turns": n_turns,
            "p50_ms": statistics.median(samples) * 1e3,
            "cpu_ms_per_turn": cpu * 1e3 / n_turns,
            "by_thread": by_kind,
            "wal_frames_per_turn": _wal_frames_per_turn(node, turns),
            "chunk_bytes": int(node.chunk_bytes_per_token * 256),
        }
    finally:
        node.close()


def probe(root: Path, name: str, n_turns: int) -> dict[str, Any]:
    """`name`'s arms in alternating pairs of turns on one node: p50 without (A) and with (B)."""
    node = noop_node(root, 8)
    toggle = _Toggle()
    arms: dict[bool, list[float]] = {False: [], True: []}
    try:
        turns = _Turns(node, seed=2)
        with _probe(name, toggle) as before_turn:
            for i in range(20 + n_turns):
                toggle.on = (i // 2) % 2 == 1
                before_turn()
                elapsed = turns.one()
                if i >= 20:
                    arms[toggle.on].append(elapsed)
    finally:
        node.close()
    a, b = statistics.median(arms[False]) * 1e3, statistics.median(arms[True]) * 1e3
    return {
        "probe": name,
        "turns_per_arm": len(arms[False]),
        "p50_ms_a": a,
        "p50_ms_b": b,
        "b_minus_a_ms": b - a,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--turns", type=int, default=600, help="measured turns of the anatomy")
    parser.add_argument(
        "--probe-turns", type=int, default=800, help="measured turns of each probe (both arms)"
    )
    parser.add_argument(
        "--probes", default=",".join(PROBES), help="comma-separated probes to run ('' for none)"
    )
    parser.add_argument("--anchor-calls", type=int, default=200, help="calls of the floor's bare stream")
    args = parser.parse_args(argv)
    probes = [p for p in args.probes.split(",") if p]
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        parser.error(f"--probes: unknown {', '.join(unknown)}; known: {', '.join(PROBES)}")
    if args.turns < 2 or args.probe_turns < 4 or args.anchor_calls < 2:
        parser.error("--turns >= 2, --probe-turns >= 4 and --anchor-calls >= 2 are needed for a p50 of each")
    logs_to_stderr()
    enter_numerics("auto", "benchmarks.bench_turn_anatomy", argv)
    torch.set_num_threads(1)
    out = table_stream(args.json)
    with tempfile.TemporaryDirectory(prefix="kvresume-anatomy-") as tmp:
        root = Path(tmp)
        turn = anatomy(root / "anatomy", args.turns)
        floor = measure_turn_floor(turn["chunk_bytes"], calls=args.anchor_calls)
        probed = [probe(root / f"probe-{p}", p, args.probe_turns) for p in probes]
    ratio = turn["p50_ms"] / floor["turn_floor_ms_c1"]
    print(
        f"one no-op session: p50 {turn['p50_ms']:.2f} ms = {ratio:.2f}x the floor "
        f"{floor['turn_floor_ms_c1']:.2f} ms (stream {floor['grpc_stream_c1']['p50_ms']:.2f}, SQLite commit "
        f"{floor['sqlite_synced_commit_ms']:.2f}, RocksDB batch {floor['rocksdb_synced_batch_ms']:.2f}); "
        f"target <= 2x",
        file=out,
    )
    print(f"process CPU a turn {turn['cpu_ms_per_turn']:.2f} ms, by thread:", file=out)
    for kind, v in sorted(turn["by_thread"].items(), key=lambda kv: -kv[1]["cpu_ms"]):
        print(f"  {kind:20s} {v['cpu_ms']:6.2f} ms  {v['switches']:6.1f} context switches", file=out)
    frames = turn["wal_frames_per_turn"]
    print(
        f"registry WAL frames a turn: {frames:.1f}" if frames is not None else "registry WAL: n/a", file=out
    )
    if probed:
        print("what-if probes (alternating pairs of turns, same process):", file=out)
        print(f"  {'probe':24s} {'A p50 ms':>9s} {'B p50 ms':>9s} {'B - A ms':>9s}", file=out)
        for p in probed:
            print(
                f"  {p['probe']:24s} {p['p50_ms_a']:9.3f} {p['p50_ms_b']:9.3f} {p['b_minus_a_ms']:+9.3f}",
                file=out,
            )
    print(f"hardware: {cpu_model()}, {os.cpu_count()} CPUs", file=out)
    write_json(
        {
            "benchmark": "bench_turn_anatomy",
            "model": "NO-OP STAND-IN (bench_service.NoOpCompute)",
            "p50_ms_c1_noop": turn["p50_ms"],
            "anchor_turn_floor_ms_c1": floor["turn_floor_ms_c1"],
            "ratio_to_floor": ratio,
            "turn": turn,
            "floor": floor,
            "probes": probed,
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "numerics": numerics_record(),
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
