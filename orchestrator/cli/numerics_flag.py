"""The `--numerics` flag of the commands that compute with a model (`model check`, `demo`, `serve`), and
entering the chosen CPU path before they load torch's kernels (orchestrator/numerics_env.py)."""

from __future__ import annotations

import argparse

from orchestrator.numerics_env import CPU_PATHS, enter_cpu_path

__all__ = ["add_numerics_flag", "enter_numerics"]


def add_numerics_flag(parser: argparse.ArgumentParser, *, default: str | None, what: str) -> None:
    """`--numerics portable|native`; `default` None means "from the settings" (serve)."""
    shown = default if default is not None else "the model_numerics setting, portable unless set"
    parser.add_argument(
        "--numerics",
        choices=CPU_PATHS,
        default=default,
        help=f"CPU code path of {what}: portable (the pinned AVX2 profile of the conformance vectors, "
        f"applied before torch loads, re-running the command if needed) or native (this environment "
        f"as it is; no bitwise conformance claimed). Default: {shown}",
    )


def enter_numerics(args: argparse.Namespace, cpu_path: str) -> int | None:
    """Enter `cpu_path` for this command (see `numerics_env.enter_cpu_path`): None to go on here, or the
    exit code of the child process that ran the command under the profile."""
    return enter_cpu_path(cpu_path, getattr(args, "command_argv", None))
