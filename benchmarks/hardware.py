"""What the benchmarks say about the machine they ran on (every figure names its hardware and numerics
profile), and entering a numerics profile before a benchmark computes."""

from __future__ import annotations

import os
import sys

from orchestrator.numerics_env import (
    PINNED_ENVS,
    PORTABLE_ENV,
    cpu_model_name,
    enter_cpu_path,
    env_mismatches,
    in_force_problems,
    profile_report,
    resolve_cpu_path,
)

__all__ = ["cpu_model", "enter_numerics", "numerics_record"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    return cpu_model_name()


def enter_numerics(cpu_path: str, module: str, argv: list[str] | None) -> None:
    """Run this benchmark under `cpu_path` ("auto", "portable", "strict" or "native"): when a pinned
    environment is not in force, `python -m <module>` re-runs in a process that starts under it (replacing
    this one when `argv` is None, else as a child whose exit code ends this process)."""
    cpu_path = resolve_cpu_path(cpu_path)
    rc = enter_cpu_path(cpu_path, argv, module=module)
    if rc is not None:
        sys.exit(rc)
    from model import configure_torch

    configure_torch(cpu_path)


def numerics_record() -> dict[str, object]:
    """The numerics profile this process computes with, for the benchmark's JSON: a pinned path
    (`portable`, `strict`) when its environment and torch's state match it, else `native`."""
    if "torch" not in sys.modules:
        pinned = [p for p in PINNED_ENVS if not env_mismatches(None, p)]
        return {
            "cpu_path": pinned[0] if pinned else "native",
            "env": {k: os.environ.get(k) for k in PORTABLE_ENV},
            "torch": "not loaded (no model arithmetic in this benchmark)",
        }
    pinned = [p for p in PINNED_ENVS if not in_force_problems(p)]
    return profile_report(pinned[0] if pinned else "native")
