"""`kvresume eval`: the answer-quality harness over the sibling checkpoints (held-out loss, recall against
distance per resume path, KL against cold prefill); the same run as `python -m benchmarks.bench_quality`
(server install).

The harness's options live in `model` (added when the command is chosen); `--json [PATH|-]` is the
shared one of every command. Exit code 1 when the full-hit path is not bit-identical to the
uninterrupted computation.
"""

from __future__ import annotations

import argparse

from orchestrator.cli.numerics_flag import add_numerics_flag, enter_numerics
from orchestrator.cli.output import add_json_flag


def _options(parser: argparse.ArgumentParser) -> None:
    from model import add_eval_arguments

    add_eval_arguments(parser)
    # The harness's own --json needs a value; it becomes the shared form (a bare --json means stdout),
    # which the harness writes the same way ("-": stdout, tables to stderr; else a file).
    harness_json = next(a for a in parser._actions if a.dest == "json")
    shared = argparse.ArgumentParser(add_help=False)
    add_json_flag(shared, what="the quality document")
    for field in ("nargs", "const", "default", "metavar", "help"):
        setattr(harness_json, field, getattr(shared._actions[0], field))
    add_numerics_flag(parser, default="auto", what="the harness")


def _run(args: argparse.Namespace) -> int:
    rc = enter_numerics(args, args.numerics)
    if rc is not None:
        return rc
    from model import configure_torch, eval_from_args
    from orchestrator.numerics_env import profile_report

    configure_torch(args.numerics)
    return eval_from_args(args, numerics=profile_report(args.numerics))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="answer quality of the sibling checkpoints per resume path (server)", options=_options
    )
    parser.set_defaults(handler=_run)
