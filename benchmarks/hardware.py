"""What the benchmarks say about the machine they ran on (every figure names its hardware and numerics
profile), and entering a numerics profile before a benchmark computes."""

from __future__ import annotations

import os
import sys

from orchestrator.numerics_env import (
    PORTABLE_ENV,
    cpu_model_name,
    enter_cpu_path,
    env_mismatches,
    in_force_problems,
    profile_report,
)

__all__ = ["cpu_model", "enter_numerics", "numerics_record"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    return cpu_model_name()


def enter_numerics(cpu_path: str, module: str, argv: list[str] | None) -> None:
    """Run this benchmark under `cpu_path` ("portable" or "native"): when the portable environment is
    not in force, `python -m <module>` re-runs in a process that starts under it (replacing this one when
    `argv` is None, else as a child whose exit code ends this process)."""
    rc = enter_cpu_path(cpu_path, argv, module=module)
    if rc is not None:
        sys.exit(rc)
    from model import configure_torch

    configure_torch(cpu_path)


def numerics_record() -> dict[str, object]:
    """The numerics profile this process computes with, for the benchmark's JSON: `portable` when its
    environment and torch's state match the pinned profile, else `native`."""
    if "torch" not in sys.modules:
        return {
            "cpu_path": "portable" if not env_mismatches() else "native",
            "env": {k: os.environ.get(k) for k in PORTABLE_ENV},
            "torch": "not loaded (no model arithmetic in this benchmark)",
        }
    return profile_report("portable" if not in_force_problems("portable") else "native")
