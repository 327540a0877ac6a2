"""The real-model load of this tree against another revision's, in alternating runs: the A/B that
`bench_service --model-load` cannot give when the machine's speed drifts more than a change moves it.

Run: `python -m benchmarks.bench_ab_load [--base REV] [--pairs 3] [--sessions 64] [--turns 20]
[--scheduler batching] [--noop] [--json PATH|-]`.

Why: on the 2-core VMs the same code's turns/s moved 10-25% between runs within a session (sessions 19-21:
orchestrator/README.md), more than most changes to the model's passes move it. Runs of the two trees one
right after the other, pair after pair, meet the same drift; the ratio of each pair is what counts.

Each arm is `benchmarks.service_model_load.model_load` as `bench_service --model-load` runs it (a model
process, the CPU split, loopback gRPC, v41-sib-s), imported from that arm's own tree, in a child process
of its own under this process's numerics environment. The base tree is a temporary `git worktree` of REV
(removed after). The pairs alternate which arm runs first (base first in odd pairs, this tree first in
even ones), so that a drift within a pair, or a cost of running second, meets both arms alike (until
session 39 the base always ran first: in one run the model process, the same code in both arms, took
1.048x the CPU a turn in the second arm). Reported per pair, in the order run: turns/s, the model
process's CPU a turn (with its `prefill_many` and `decode_many`), the service process's CPU a turn,
client p99, `svc_over_model`, the service's CPU a turn over the model process's, and `model_busy`, the
model process's CPU over the arm's wall (turns/s times its CPU a turn); and the median and mean of the
pairs' ratios (this tree over the base). Where only the service differs between the trees, the model
process's CPU a turn measures the machine's speed during each arm, and `svc_over_model` is the service's
cost with that drift divided out. With the model process on a CPU of its own, turns/s is `model_busy`
over its CPU a turn: a change to how steps are formed shows in both (session 40's pipelined steps raised
`model_busy` from 0.94 to 0.96-0.97 and the CPU a turn by 1.08x: smaller decode batches).

`--noop`: the arms are `bench_service`'s no-op sweeps instead (`bench_service.overhead` from the arm's
tree, the thread-pool gRPC server, the NO-OP STAND-IN): `--sessions` sessions at once, `--turns` measured
turns each (default 8), then one session at a time as the one-session sweep runs it. Reported: the
64-session turns/s, p99 and the process's CPU a turn, and the one-session p50 (`c1_p50_ms`): the service's
side of issue 11's targets, whose sweeps a drifting VM moves 10-20% between runs (orchestrator/README,
session 38). There is no figure with the machine's speed divided out here: a fixed pure-Python workload
timed in each child before and after its sweeps (tried in session 39) moved 7.7-12.6 ms between arms and
did not follow the sweeps' own CPU a turn, so judge by several pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, table_stream, write_json
from orchestrator.numerics_env import resolve_cpu_path

REPO = Path(__file__).resolve().parents[1]
_CHECKPOINT = Path("checkpoints") / "v41-sib-s"
_MARK = "AB-RESULT "

# Every child's start, from its own tree: its arguments, the numerics profile, the service's log lines.
CHILD_START = """
import json, sys, tempfile
from pathlib import Path
args = json.loads(sys.argv[1])
from model import configure_torch
configure_torch(args["cpu_path"])
try:
    from benchmarks.report import logs_to_stderr
    logs_to_stderr()
except ImportError:
    pass
"""

# What a child runs then: only what every revision with a model-load run has.
_CHILD = CHILD_START + """
from benchmarks.service_model_load import model_load
with tempfile.TemporaryDirectory() as d:
    r = model_load(Path(d), Path(args["checkpoint"]).resolve(), scheduler=args["scheduler"],
                   sessions=args["sessions"], turns=args["turns"], model_process="separate")
print(MARK + json.dumps(r), flush=True)
""".replace("MARK", repr(_MARK))

# What a `--noop` child runs then (revisions whose `overhead` takes the gRPC server).
_NOOP_CHILD = CHILD_START + """
from benchmarks.bench_service import overhead
with tempfile.TemporaryDirectory() as d:
    many = overhead(Path(d) / "many", args["sessions"], args["turns"], "threads")
    one = overhead(Path(d) / "one", 1, args["turns"], "threads")
print(MARK + json.dumps({"turns_per_s": many["turns_per_s"], "p99_ms": many["p99_ms"],
                         "service_cpu_ms_per_turn": many["cpu_ms_per_turn"], "c1_p50_ms": one["p50_ms"]}),
      flush=True)
""".replace("MARK", repr(_MARK))

# The figures kept of each arm (model_load's keys), and the pass operations of the model process.
_KEYS = ("turns_per_s", "p99_ms", "model_process_cpu_ms_per_turn", "service_cpu_ms_per_turn")
_OPS = ("prefill_many", "decode_many")
_NOOP_KEYS = ("turns_per_s", "p99_ms", "service_cpu_ms_per_turn", "c1_p50_ms")


def run_arm(tree: Path, args: dict[str, Any], *, noop: bool = False) -> dict[str, Any]:
    """One load run of `tree`'s code in a child process; its figures (`_KEYS`, and `_OPS` as `op_ms`;
    with `noop`, the no-op sweeps' `_NOOP_KEYS`).

    Raises:
        RuntimeError: the child failed or printed no result.
    """
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", _NOOP_CHILD if noop else _CHILD,
         json.dumps({**args, "checkpoint": str(tree / _CHECKPOINT)})],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the load run of {tree} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(lines[-1].removeprefix(_MARK))
    if noop:
        return {k: result.get(k) for k in _NOOP_KEYS}
    ops = result.get("model_ops_cpu_ms_per_turn") or {}
    arm = {**{k: result.get(k) for k in _KEYS}, **{f"{op}_ms": ops.get(op) for op in _OPS}}
    return with_model_busy(with_svc_over_model(arm))


def with_svc_over_model(arm: dict[str, Any]) -> dict[str, Any]:
    """`arm` with `svc_over_model`: its service CPU a turn over its model process's (None without both)."""
    svc, model = arm.get("service_cpu_ms_per_turn"), arm.get("model_process_cpu_ms_per_turn")
    return {**arm, "svc_over_model": svc / model if svc is not None and model else None}


def with_model_busy(arm: dict[str, Any]) -> dict[str, Any]:
    """`arm` with `model_busy`: its model process's CPU over its wall, turns/s times the CPU a turn (None
    without both; computed here, so a base revision whose load run does not report it has it too)."""
    rate, model = arm.get("turns_per_s"), arm.get("model_process_cpu_ms_per_turn")
    return {**arm, "model_busy": rate * model / 1e3 if rate is not None and model is not None else None}


def summarize(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The median and mean over the pairs of this tree's figure over the base's, for every figure both
    arms of every pair have (a figure missing from one arm, such as a model process's CPU without one,
    is left out).

    Raises:
        ValueError: no pairs.
    """
    if not pairs:
        raise ValueError("no pairs to summarize")
    out: dict[str, Any] = {}
    for key in pairs[0][0]:
        ratios = [new[key] / base[key] for base, new in pairs if base.get(key) and new.get(key) is not None]
        if len(ratios) == len(pairs):
            out[key] = {"median_ratio": statistics.median(ratios), "mean_ratio": statistics.fmean(ratios),
                        "ratios": ratios}  # fmt: skip
    return out


def run_order(pair: int) -> tuple[str, str]:
    """Which arm of pair `pair` (1-based) runs first: the base in odd pairs, this tree in even ones."""
    return ("base", "this") if pair % 2 else ("this", "base")


@contextmanager
def checked_out(rev: str, into: Path) -> Iterator[Path]:
    """REV as a temporary `git worktree` of this repository under `into`, removed on leaving.

    Raises:
        SystemExit: git cannot check REV out.
    """
    path = into / "base"
    done = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"cannot check out {rev!r} beside this tree: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       capture_output=True, check=False)  # fmt: skip


_ROW_KEYS = ("turns_per_s", "p99_ms", "model_process_cpu_ms_per_turn", "prefill_many_ms", "decode_many_ms",
             "service_cpu_ms_per_turn", "svc_over_model", "model_busy")  # fmt: skip


_HEADS = {"turns_per_s": "turns/s", "p99_ms": "p99 ms", "model_process_cpu_ms_per_turn": "model ms/t",
          "prefill_many_ms": "prefill", "decode_many_ms": "decode", "service_cpu_ms_per_turn": "svc ms/t",
          "svc_over_model": "svc/model", "model_busy": "busy", "c1_p50_ms": "c1 p50 ms"}  # fmt: skip


def _row(pair: int, arm: str, r: dict[str, Any], keys: Sequence[str] = _ROW_KEYS) -> str:
    def f(key: str) -> str:
        v = r.get(key)
        if not isinstance(v, int | float):
            return f"{'-':>9}"
        return f"{v:9.3f}" if abs(v) < 10 else f"{v:9.2f}"

    return f"{pair:4d} {arm:5s} " + " ".join(f(k) for k in keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="the revision to compare with (default HEAD~1)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=None, help="turns per session (20; --noop: 8)")
    parser.add_argument("--scheduler", choices=("batching", "serial"), default="batching")
    parser.add_argument("--noop", action="store_true", help="the no-op sweeps instead of the model load")
    parser.add_argument("--numerics", choices=("auto", "portable", "strict", "native"), default="auto")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if args.turns is None:
        args.turns = 8 if args.noop else 20
    if args.pairs < 1 or args.sessions < 1 or args.turns < 1:
        parser.error(f"--pairs, --sessions and --turns must be positive, got {args.pairs}, {args.sessions}, "
                     f"{args.turns}")  # fmt: skip
    enter_numerics(args.numerics, "benchmarks.bench_ab_load", argv)
    out = table_stream(args.json)
    arm_args = {"scheduler": args.scheduler, "sessions": args.sessions, "turns": args.turns,
                "cpu_path": resolve_cpu_path(args.numerics)}  # fmt: skip
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp, checked_out(args.base, Path(tmp)) as base:
        what = "no-op stand-in" if args.noop else args.scheduler
        print(f"bench_ab_load: {args.sessions} sessions x {args.turns} turns ({what}), this "
              f"tree against {args.base}, {args.pairs} pairs, {cpu_model()}", file=out)  # fmt: skip
        keys = _NOOP_KEYS if args.noop else _ROW_KEYS
        print("pair arm  " + " ".join(f"{_HEADS[k]:>9}" for k in keys), file=out)
        for i in range(1, args.pairs + 1):
            arms = {"base": base, "this": REPO}
            got: dict[str, dict[str, Any]] = {}
            for name in run_order(i):
                got[name] = run_arm(arms[name], arm_args, noop=args.noop)
                print(_row(i, name, got[name], keys), file=out, flush=True)
            pairs.append((got["base"], got["this"]))
    summary = summarize(pairs)
    for key, s in summary.items():
        print(f"  {key}: median {s['median_ratio']:.3f}x, mean {s['mean_ratio']:.3f}x (this tree over the "
              "base)", file=out)  # fmt: skip
    doc = {"base": args.base, **arm_args, "noop": args.noop,
           "pairs": [{"base": b, "this": a} for b, a in pairs], "summary": summary, "cpu": cpu_model(),
           "numerics": numerics_record()}  # fmt: skip
    write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
