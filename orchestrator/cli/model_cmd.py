"""`kvresume model ...`: byte accounting and conformance checks of the model package."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model utilities (bytes, check)")
    parser.add_subparsers(dest="model_command", required=True)
