"""`kvresume eval`: the answer-quality harness over the sibling checkpoints (held-out loss, recall against
distance per resume path, KL against cold prefill); the same run as `python -m benchmarks.bench_quality`.

Exit code 1 when the full-hit path is not bit-identical to the uninterrupted computation.
"""

from __future__ import annotations

import argparse

from model import add_eval_arguments, eval_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="answer quality of the sibling checkpoints per resume path")
    add_eval_arguments(parser)
    parser.set_defaults(handler=eval_from_args)
