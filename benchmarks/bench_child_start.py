"""How long a helper process takes to start: forked from a launcher that has its imports done
(`child_start = "preloaded"`, orchestrator/child_launcher.py) against `python -m` (`"exec"`), side by
side in one process.

Run: `python -m benchmarks.bench_child_start [--starts 6] [--json PATH|-]`.

Two helpers, each started `--starts` times per arm, the arms alternating start by start (the order
flipped every other pair, so the machine's drift meets both):
- the model process (v41-tiny, seed 1): a new `ProcessCompute`'s first call, `new_state`: its process's
  start, the model's load there, the fingerprint check and the call, what a turn waits for when a model
  process has died and the next call starts another;
- the registry writer: `RegistryWriter.start` on a migrated SQLite file (until its ready line).
Reported per helper: the median wall of a start, each arm, and the ratio (exec over preloaded). The
preloaded arm's first start also starts its launcher (the imports it then holds); it is reported apart
(`first_preloaded_ms`) and left out of the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.hardware import cpu_model, enter_numerics, numerics_record
from benchmarks.report import add_json_flag, logs_to_stderr, table_stream, write_json
from orchestrator.db import upgrade
from orchestrator.engine import ModelRegistry, ServedModelSpec
from orchestrator.model_process import ProcessCompute
from orchestrator.registry_writer import RegistryWriter

ARMS = ("exec", "preloaded")


def _model_process_start(registry: ModelRegistry) -> Callable[[str], float]:
    served = registry.get("a")

    def start(arm: str) -> float:
        compute = ProcessCompute.from_registry(registry, threads=1, child_start=arm)
        try:
            t0 = time.perf_counter()
            compute.new_state(served)
            return time.perf_counter() - t0
        finally:
            compute.close()

    return start


def _registry_writer_start(url: str) -> Callable[[str], float]:
    def start(arm: str) -> float:
        writer = RegistryWriter(url, connections=1, child_start=arm)
        try:
            t0 = time.perf_counter()
            writer.start()
            return time.perf_counter() - t0
        finally:
            writer.close()

    return start


def measure(start: Callable[[str], float], starts: int) -> dict[str, Any]:
    """`starts` starts per arm, alternating; medians in ms, the preloaded arm's first start apart."""
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(starts + 1):  # one more preloaded start: the first, which starts the launcher
        order = ARMS if i % 2 == 0 else ARMS[::-1]
        for arm in order:
            if arm == "exec" and i == starts:
                continue
            seconds[arm].append(start(arm))
    first = seconds["preloaded"].pop(0)
    exec_ms = statistics.median(seconds["exec"]) * 1e3
    preloaded_ms = statistics.median(seconds["preloaded"]) * 1e3
    return {
        "exec_ms": exec_ms,
        "preloaded_ms": preloaded_ms,
        "ratio": exec_ms / preloaded_ms,
        "first_preloaded_ms": first * 1e3,
        "starts": starts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_flag(parser)
    parser.add_argument("--starts", type=int, default=6, help="starts per arm and helper (>= 1)")
    args = parser.parse_args(argv)
    if args.starts < 1:
        parser.error(f"--starts={args.starts} must be >= 1")
    # the model process computes under this process's numerics environment, as `kvresume serve`'s does
    enter_numerics("auto", "benchmarks.bench_child_start", argv)
    logs_to_stderr()
    registry = ModelRegistry({"a": ServedModelSpec(name="a", config="v41-tiny", seed=1)})
    doc: dict[str, Any] = {"cpu": cpu_model(), "numerics": numerics_record(), "helpers": {}}
    with tempfile.TemporaryDirectory(prefix="kvresume-child-start-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'registry.sqlite3'}"
        upgrade(url)
        doc["helpers"]["model_process"] = measure(_model_process_start(registry), args.starts)
        doc["helpers"]["registry_writer"] = measure(_registry_writer_start(url), args.starts)
    out = table_stream(args.json)
    print(f"helper process start, median ms (alternating arms, {args.starts} each); {cpu_model()}", file=out)
    header = f"{'helper':>16} {'python -m':>10} {'preloaded':>10} {'ratio':>6} {'first preloaded':>15}"
    print(header, file=out)
    for name, r in doc["helpers"].items():
        print(
            f"{name:>16} {r['exec_ms']:>10.0f} {r['preloaded_ms']:>10.0f} {r['ratio']:>6.2f} "
            f"{r['first_preloaded_ms']:>15.0f}",
            file=out,
        )
    write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
