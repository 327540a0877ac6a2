"""The `kvresume` command line: one argparse tree, each command group in its own module.

Exit codes: 0 on success, 1 on any failure (the message goes to stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import grpc

__all__ = ["main", "build_parser"]

# Each command-group module exposes `register(subparsers)`; a registered sub-command sets
# `handler(args) -> int` through `set_defaults`.
_GROUPS: tuple[str, ...] = (
    "model_cmd", "demo_cmd", "serve_cmd", "admin_cmd", "session_cmd", "train_cmd", "eval_cmd", "mapper_cmd"
)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="kvresume", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _GROUPS:
        module = importlib.import_module(f"orchestrator.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The arguments again, for commands that must re-run under a numerics profile (None: sys.argv).
    args.command_argv = None if argv is None else list(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except (ValueError, OSError) as exc:
        print(f"kvresume {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        # A call to our own (or an embedded) server failed: its status and details, not a traceback.
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"kvresume {args.command}: error: {code}: {details}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
