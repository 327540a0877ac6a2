"""`kvresume eval`: the answer-quality harness over the sibling checkpoints (held-out loss, recall against
distance per resume path, KL against cold prefill); the same run as `python -m benchmarks.bench_quality`.

Exit code 1 when the full-hit path is not bit-identical to the uninterrupted computation.
"""

from __future__ import annotations

import argparse

from model import add_eval_arguments, configure_torch, eval_from_args
from orchestrator.cli.numerics_flag import add_numerics_flag, enter_numerics
from orchestrator.numerics_env import profile_report


def _run(args: argparse.Namespace) -> int:
    rc = enter_numerics(args, args.numerics)
    if rc is not None:
        return rc
    configure_torch(args.numerics)
    return eval_from_args(args, numerics=profile_report(args.numerics))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="answer quality of the sibling checkpoints per resume path")
    add_eval_arguments(parser)
    add_numerics_flag(parser, default="portable", what="the harness")
    parser.set_defaults(handler=_run)
