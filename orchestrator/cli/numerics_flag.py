"""The `--numerics` flag of the commands that compute with a model (`model check`, `demo`, `serve`), and
entering the chosen CPU path before they load torch's kernels (orchestrator/numerics_env.py)."""

from __future__ import annotations

import argparse

from orchestrator.numerics_env import CPU_PATH_CHOICES, enter_cpu_path, resolve_cpu_path

__all__ = ["add_numerics_flag", "enter_numerics"]


def add_numerics_flag(parser: argparse.ArgumentParser, *, default: str | None, what: str) -> None:
    """`--numerics auto|portable|strict|native`; `default` None means "from the settings" (serve)."""
    shown = default if default is not None else "the model_numerics setting, auto unless set"
    parser.add_argument(
        "--numerics",
        choices=CPU_PATH_CHOICES,
        default=default,
        help=f"CPU code path of {what}: portable (the pinned AVX2 profile of the conformance vectors, "
        f"applied before torch loads, re-running the command if needed), strict (the same with MKL's "
        f"strict CNR mode: exact where portable's GEMMs are not, not the vectors' bits), native (this "
        f"environment as it is; no bitwise conformance claimed) or auto (portable where its GEMM probe "
        f"passes, else strict). Default: {shown}",
    )


def enter_numerics(args: argparse.Namespace, cpu_path: str) -> int | None:
    """Enter `cpu_path` ("auto" resolved first, and the result left in `args.numerics` for the command to
    read) for this command (see `numerics_env.enter_cpu_path`): None to go on here, or the exit code of
    the child process that ran the command under the profile."""
    cpu_path = resolve_cpu_path(cpu_path)
    if getattr(args, "numerics", None) is not None:
        args.numerics = cpu_path
    return enter_cpu_path(cpu_path, getattr(args, "command_argv", None))
