"""Where the service's threads hand the GIL over at 64 sessions: the no-op sweep of `bench_service`
(thread-pool gRPC server, NO-OP STAND-IN) recorded with Linux `perf`, each time a thread of the process
had to wait for the interpreter lock counted by the C function that had let go of it.

Run: `python -m benchmarks.bench_gil_handovers [--base REV] [--rounds 2] [--sessions 64] [--turns 40]
[--seconds 2] [--json PATH|-]`. Needs `perf` with the `sched:sched_switch` tracepoint and DWARF unwinding
(root, or `kernel.perf_event_paranoid` low enough); it says so and exits 2 otherwise.

Why: at 64 sessions the service's turns/s is bound by the one GIL of the process that runs the handlers,
gRPC's threads and the in-process clients, and the turns/s of the same code moves 10-20% between runs
on the 2-vCPU VMs. Counts of hand-overs a turn move far less (orchestrator/README.md, "Session 39": the
turn's registry reads in one statement took the sqlite3 ones from 26 to 10-12 a turn in 4 runs, while
turns/s read 149 / 148 against 165 / 151). Each arm runs in a child process importing its own tree (the
base: a temporary `git worktree` of REV, as `bench_ab_load` makes it), arms alternating round by round
as its pairs do; `perf record -a` runs for `--seconds` once the child's measured turns have started
(`overhead`'s `on_measuring`, so REV must be of session 39 or later), and only the child's threads are
counted. A turn's figures divide by the turns of that window (the sweep's turns/s times its length).

Reported per arm and round: turns/s, the process's threads' switch-outs a turn, the waits for the GIL a
turn (switch-outs inside `take_gil`) and those by who let go (`CATEGORIES`: Python locks, RLocks,
sqlite3, gRPC's Cython, file and pipe I/O, the queue of gRPC's worker pool, RocksDB, hashlib, numpy,
torch, other).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.bench_ab_load import CHILD_START, REPO, checked_out, run_order
from benchmarks.hardware import cpu_model, enter_numerics
from benchmarks.report import add_json_flag, table_stream, write_json
from orchestrator.numerics_env import resolve_cpu_path

_MARK_START, _MARK_RESULT = "GIL-MEASURING", "GIL-RESULT "

# The child, from its arm's tree (started as `bench_ab_load`'s children): the no-op sweep, saying when its
# measured turns start.
_SWEEP = """
from benchmarks.bench_service import overhead
import inspect
if "on_measuring" not in inspect.signature(overhead).parameters:
    raise SystemExit("this tree's bench_service.overhead takes no on_measuring (before session 39)")
def started():
    print(START, flush=True)
with tempfile.TemporaryDirectory() as d:
    r = overhead(Path(d), args["sessions"], args["turns"], "threads", on_measuring=started)
print(RESULT + json.dumps({"turns_per_s": r["turns_per_s"]}), flush=True)
"""
_CHILD = CHILD_START + _SWEEP.replace("START", repr(_MARK_START)).replace("RESULT", repr(_MARK_RESULT))

# Who let go of the GIL, by the first two frames under `PyEval_RestoreThread` (symbols, or the libraries'
# paths), the first category that matches (an RLock's frames hold a lock's too).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("rlock", ("rlock_acquire",)),
    ("lock", ("lock_PyThread_acquire_lock", "acquire_timed")),
    ("sqlite3", ("pysqlite", "stmt_", "bind_parameters", "_sqlite3")),
    ("grpc", ("cygrpc",)),
    ("io", ("_Py_read", "_Py_write", "os_read", "os_write", "_io_")),
    ("queue", ("_queue_SimpleQueue",)),
    ("rocksdb", ("rocksdict", "rocksdb")),
    ("hashlib", ("_hashlib", "EVP_", "py_evp")),
    ("numpy", ("_multiarray", "_PyArray", "numpy", "PyUFunc")),
    ("torch", ("THP", "libtorch", "torch")),
)


def category(frames: str) -> str:
    """The `CATEGORIES` name of frames (symbols and libraries as `perf script` prints them)."""
    for name, needles in CATEGORIES:
        if any(n in frames for n in needles):
            return name
    return "other"


def parse_switches(text: Iterable[str], pid: int) -> dict[str, Any]:
    """Switch-outs of process `pid` in `perf script -F comm,pid,tid,ip,sym,dso` output of
    `sched:sched_switch` with call graphs: how many, how many inside `take_gil`, and those by `category`
    of the frame that had let go of the GIL (the first under `PyEval_RestoreThread`)."""
    switches, waits = 0, 0
    by: Counter[str] = Counter()
    frames: list[str] = []
    mine = False

    def close() -> None:
        nonlocal switches, waits
        if not mine:
            return
        switches += 1
        names = [f.split(" (")[0] for f in frames]
        if "take_gil" not in names:
            return
        waits += 1
        # what let go: the frames under take_gil and PyEval_RestoreThread (two: an RLock's acquire is
        # acquire_timed under rlock_acquire); frames perf could name neither by symbol nor by library skipped
        under = [
            f for f in frames[names.index("take_gil") + 1 :]
            if not f.startswith("PyEval_RestoreThread") and f != "[unknown] ([unknown])"
        ]  # fmt: skip
        by[category(" < ".join(under[:2]))] += 1

    for raw in text:
        line = raw.rstrip("\n")
        if not line.strip():
            close()
            frames, mine = [], False
            continue
        if not line[:1].isspace():
            close()
            frames = []
            parts = line.split()
            ids = next((p for p in parts if "/" in p and p.replace("/", "").isdigit()), "")
            mine = ids.split("/")[0] == str(pid)
            continue
        parts = line.strip().split(None, 1)
        if len(parts) == 2:
            frames.append(parts[1])
    close()
    return {"switches": switches, "gil_waits": waits, "by": dict(by)}


def perf_usable() -> str | None:
    """None when `perf` can record the scheduler's switches with call graphs here, else why not."""
    if shutil.which("perf") is None:
        return "no perf on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            ["perf", "record", "-q", "-e", "sched:sched_switch", "--call-graph", "dwarf,1024",
             "-o", str(Path(tmp) / "probe.data"), "--", "true"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        return f"perf record -e sched:sched_switch --call-graph dwarf failed: {done.stderr.strip()[-300:]}"
    return None


def run_arm(tree: Path, args: dict[str, Any], seconds: float, work: Path) -> dict[str, Any]:
    """One sweep of `tree`'s code in a child process, recorded for `seconds` once its turns started.

    Raises:
        RuntimeError: the child or perf failed, or the child never started its measured turns.
    """
    env = dict(os.environ, PYTHONPATH=str(tree))
    log = work / "child.log"
    with log.open("w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
    data = work / "switches.data"

    def tail() -> str:
        return log.read_text(errors="replace")[-1500:]

    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == _MARK_START:
                break
        else:
            raise RuntimeError(
                f"the sweep of {tree} ended before its measured turns (exit {child.wait()}): {tail()}"
            )
        rec = subprocess.run(
            ["perf", "record", "-q", "-a", "-e", "sched:sched_switch", "--call-graph", "dwarf,8192",
             "-o", str(data), "--", "sleep", str(seconds)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if rec.returncode != 0:
            raise RuntimeError(f"perf record failed: {rec.stderr.strip()[-500:]}")
        result = None
        for line in child.stdout:
            if line.startswith(_MARK_RESULT):
                result = json.loads(line.removeprefix(_MARK_RESULT))
        if child.wait() != 0 or result is None:
            raise RuntimeError(f"the sweep of {tree} failed (exit {child.returncode}): {tail()}")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    script = subprocess.Popen(
        ["perf", "script", "-i", str(data), "-F", "comm,pid,tid,ip,sym,dso"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, errors="replace",
    )  # fmt: skip
    assert script.stdout is not None
    counted = parse_switches(script.stdout, child.pid)
    script.wait()
    data.unlink(missing_ok=True)
    turns = result["turns_per_s"] * seconds
    return {
        "turns_per_s": result["turns_per_s"],
        "switches_per_turn": counted["switches"] / turns,
        "gil_waits_per_turn": counted["gil_waits"] / turns,
        "gil_waits_by": {k: v / turns for k, v in sorted(counted["by"].items(), key=lambda kv: -kv[1])},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--base", default=None, help="also measure this revision, arms alternating")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each arm (>= 1)")
    parser.add_argument("--sessions", type=int, default=64, help="sessions at once (>= 1)")
    parser.add_argument("--turns", type=int, default=40, help="measured turns a session (>= 1)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds recorded (> 0)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.sessions < 1 or args.turns < 1 or not args.seconds > 0:
        parser.error(
            f"--rounds, --sessions and --turns must be >= 1 and --seconds > 0, got {args.rounds}, "
            f"{args.sessions}, {args.turns}, {args.seconds}"
        )
    why = perf_usable()
    if why is not None:
        print(f"bench_gil_handovers: cannot record here: {why}", file=sys.stderr)
        return 2
    enter_numerics("auto", "benchmarks.bench_gil_handovers", argv)
    arm_args = {"sessions": args.sessions, "turns": args.turns, "cpu_path": resolve_cpu_path("auto")}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvresume-gil-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        trees = {"this": REPO}
        if args.base is not None:
            trees["base"] = stack.enter_context(checked_out(args.base, work))
        for i in range(1, args.rounds + 1):
            for name in run_order(i) if args.base is not None else ("this",):
                runs.append({"arm": name, "round": i, **run_arm(trees[name], arm_args, args.seconds, work)})
    out = table_stream(args.json)
    print(
        f"GIL hand-overs at {args.sessions} sessions x {args.turns} turns (no-op stand-in), "
        f"{args.seconds:g} s recorded a run; {cpu_model()}, {os.cpu_count()} CPUs",
        file=out,
    )
    shown = [name for name, _ in CATEGORIES] + ["other"]
    head = f"{'arm':5s} {'rnd':>3s} {'turns/s':>8s} {'switch':>7s} {'waits':>6s} "
    print(head + " ".join(f"{c:>7s}" for c in shown), file=out)
    for r in runs:
        by = r["gil_waits_by"]
        print(
            f"{r['arm']:5s} {r['round']:>3d} {r['turns_per_s']:8.1f} {r['switches_per_turn']:7.1f} "
            f"{r['gil_waits_per_turn']:6.1f} " + " ".join(f"{by.get(c, 0.0):7.1f}" for c in shown),
            file=out,
        )
    write_json(
        {"benchmark": "bench_gil_handovers", "base": args.base, **arm_args, "seconds": args.seconds,
         "runs": runs, "cpu": cpu_model(), "cpus": os.cpu_count()},
        args.json,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
