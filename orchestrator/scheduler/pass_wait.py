"""A turn waiting for a forward pass, as a value: the turn's steps yield a `PassWait` instead of blocking,
so whoever drives them chooses how to wait. `wait_inline` blocks the driving thread (the threaded front
doors, tests); the asyncio gRPC server awaits the future on its event loop, so a session whose pass is
queued behind other sessions' holds no thread (`orchestrator/api/async_steps.py`).

Knows nothing of gRPC or of what a turn is; only of futures.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["PassWait", "await_pass", "wait_inline"]

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class PassWait:
    """The steps asked for a pass whose result is not there yet. The driver resumes them only once
    `future` is done; resuming earlier is a bug of the driver (`await_pass` checks it)."""

    future: Future


def await_pass(future: Future) -> Generator[PassWait, None, Any]:
    """The pass's result, yielding one PassWait first when it is not done (use with `yield from`).

    Raises:
        the pass's own exception; RuntimeError when resumed before the pass finished.
    """
    if not future.done():
        yield PassWait(future)
        if not future.done():
            raise RuntimeError("turn steps resumed before their forward pass finished")
    return future.result()


def wait_inline(steps: Iterator[T | PassWait]) -> Iterator[T]:
    """The steps' events, blocking this thread on each pass they wait for.

    Closing this generator closes `steps` at once (a client that went away), as iterating `steps`
    directly would.
    """
    try:
        for item in steps:
            if isinstance(item, PassWait):
                wait_all([item.future])
                continue
            yield item
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
