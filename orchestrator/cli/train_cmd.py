"""`kvresume train`: train (or resume) one sibling of the model family; CPU by default, CUDA when present.

The recipe and its options live in `model.train.trainer`; this module only registers the command. Logs
go to <run-dir>/train_log.jsonl (one JSON object per line); the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse

from model import add_train_arguments, train_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train or resume a sibling model (see model/train)")
    add_train_arguments(parser)
    parser.set_defaults(handler=train_from_args)
