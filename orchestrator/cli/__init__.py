"""The `kvresume` command line: one argparse tree, each command group in its own module.

Building the tree imports no torch, model, SQL or storage module: each command imports what it needs
when it runs, so the client commands (`session`, `models`, the Admin calls, `mapper list|get` of a
server) start at once and run on the light install (`pip install kvresume`); the server commands
(`serve`, `demo`, `train`, `eval`, `model`, `mapper fit|eval`, `admin migrate|calibrate`) need
`pip install 'kvresume[server]'`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Callable, Sequence

from orchestrator.cli.command_parser import CommandParser

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# Each command-group module exposes `register(subparsers)`; a registered sub-command sets
# `handler(args) -> int` through `set_defaults`.
_GROUPS: tuple[str, ...] = (
    "serve_cmd",
    "session_cmd",
    "models_cmd",
    "admin_cmd",
    "mapper_cmd",
    "demo_cmd",
    "model_cmd",
    "train_cmd",
    "eval_cmd",
)

# Top-level modules of the `server` extra (pyproject.toml): a command that imports one on the light
# install fails with the install line instead of a traceback.
_SERVER_EXTRA = frozenset({
    "torch", "triton", "numpy", "safetensors", "grpc_health", "grpc_reflection", "sqlalchemy", "alembic",
    "psycopg", "rocksdict", "structlog", "sklearn", "prometheus_client", "tokenizers",
})  # fmt: skip

# The base error class of each of our packages (STYLE.md rule 13), looked up only in packages already
# imported: an error of a package that was never imported cannot have been raised.
_ERROR_BASES = (
    ("orchestrator.errors", "OrchestratorError"),
    ("model", "ModelError"),
    ("mappers", "MapperError"),
    ("storage", "StorageError"),
    ("kernels", "KernelError"),
)

_EPILOG = """\
(client) commands need only `pip install kvresume`; (server) ones `pip install 'kvresume[server]'`.

exit codes:
  0  success
  1  failure: the command ran and failed (a refused or failed RPC, a bad value, a failed check);
     one line `kvresume <command>: error: ...` on stderr (an RPC error reads CODE [REASON]: message)
  2  usage: the command line itself is wrong (unknown command or option, a missing argument)

output: text for people on stdout; --json [PATH|-] on every command writes JSON instead (to stdout
with a bare --json or '-', the text then going to stderr; or to the file PATH). Warnings go to stderr.

client commands read KVRESUME_TARGET (host:port; default: the settings' grpc address), KVRESUME_TOKEN
(a tenant's token) and KVRESUME_ADMIN_TOKEN (the admin token); see orchestrator/README.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kvresume",
        description="kvresume: resume LLM agent sessions from stored KV caches, over gRPC.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _GROUPS:
        importlib.import_module(f"orchestrator.cli.{name}").register(subparsers)
    return parser


def _server_extra_missing(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").split(".")[0] in _SERVER_EXTRA


def _known_error(exc: Exception) -> bool:
    import grpc

    if isinstance(exc, ValueError | OSError | grpc.RpcError):
        return True
    for module, name in _ERROR_BASES:
        base = getattr(sys.modules.get(module), name, None)
        if isinstance(base, type) and isinstance(exc, base):
            return True
    return False


def _error_text(exc: Exception) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError):
        from kvresume import rpc_error_text

        return rpc_error_text(exc)
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Returns its exit code (0, 1); usage errors exit 2 from argparse (SystemExit)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ModuleNotFoundError as exc:
        # A command's options come from the model stack (train, eval): the light install lacks it.
        if not _server_extra_missing(exc):
            raise
        words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
        print(f"kvresume {' '.join(words[:1])}: error: this command needs the server install ({exc}): "
              "pip install 'kvresume[server]'", file=sys.stderr)
        return EXIT_FAILURE
    # The arguments again, for commands that must re-run under a numerics profile (None: sys.argv).
    args.command_argv = None if argv is None else list(argv)
    name = getattr(args, "command_name", args.command)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ModuleNotFoundError as exc:
        if not _server_extra_missing(exc):
            raise
        print(f"kvresume {name}: error: this command needs the server install ({exc}): "
              "pip install 'kvresume[server]'", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        if _known_error(exc):
            text = _error_text(exc)
        else:
            # A bug, not a failed request: keep the traceback for the report, then the one-line error.
            traceback.print_exc()
            text = f"{type(exc).__name__}: {exc}"
        print(f"kvresume {name}: error: {text}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
