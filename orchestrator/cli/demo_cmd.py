"""`kvresume demo`: the main job on embedded defaults."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    print("kvresume demo: the service is not built yet; nothing to run.")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the scripted end-to-end demo")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=_run)
