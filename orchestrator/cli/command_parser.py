"""The argparse parser class of every `kvresume` command: options that need the model stack are added
only when their command is chosen, so building the whole tree (and `kvresume --help`) imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CommandParser"]


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose `options(parser)` callback, when given, runs the first time this parser
    parses (its command was chosen, `--help` included), not when the tree is built.

    A leaf's `set_defaults(handler=...)` also records `command_name` ("session get"), the name in error
    lines.
    """

    def __init__(
        self, *args: Any, options: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._options = options

    def load_options(self) -> None:
        """Add the deferred options now (parsing does it first; may import the model stack)."""
        if self._options is not None:
            options, self._options = self._options, None
            options(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.load_options()
        return super().parse_known_args(args, namespace)

    def set_defaults(self, **kwargs: Any) -> None:
        if "handler" in kwargs:
            kwargs.setdefault("command_name", self.prog.partition(" ")[2] or self.prog)
        super().set_defaults(**kwargs)
