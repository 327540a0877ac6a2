"""`kvresume train`: train (or resume) one sibling of the model family; CPU by default, CUDA when present
(server install).

The recipe and its options live in `model.train.trainer` (added when the command is chosen, so building
the command tree imports no torch); this module registers the command and writes its summary. Logs go
to <run-dir>/train_log.jsonl (one JSON object per line).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from orchestrator.cli.output import add_json_flag, text_stream, write_json


def _options(parser: argparse.ArgumentParser) -> None:
    from model import add_train_arguments

    add_train_arguments(parser)
    add_json_flag(parser, what="the run's summary")


def _run(args: argparse.Namespace) -> int:
    from model import train_from_args

    # The trainer prints its summary as a JSON line; it is this command's result, written as --json says.
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        rc = train_from_args(args)
    summary = json.loads(captured.getvalue().strip().splitlines()[-1])
    exported = f", exported to {summary['exported']}" if "exported" in summary else ""
    print(f"trained {summary['model']} to step {summary['step']} of {summary['steps']} in "
          f"{summary['seconds']} s (run dir {summary['run_dir']}{exported})", file=text_stream(args.json))
    write_json(summary, args.json)
    return rc


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train or resume a sibling model (see model/train) (server)", options=_options
    )
    parser.set_defaults(handler=_run)
