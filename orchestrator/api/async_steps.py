"""Driving a turn's steps from an asyncio event loop, so that a turn waiting for the scheduler holds no
thread: the steps' blocking stretches (registry reads and writes, sampling, the store's writes) run on a
worker pool, one stretch at a time, and each forward pass they wait for (`PassWait`) is awaited on the
loop. With 64 sessions queued behind one step only the step loop's thread is busy; the pool's threads
serve whichever stretches are ready.

Knows nothing of gRPC or of what a turn is: any iterator of events and PassWaits can be driven.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_all
from typing import Generic, TypeVar

from orchestrator.scheduler.pass_wait import PassWait

__all__ = ["AsyncSteps", "END"]

T = TypeVar("T")

# What `next` returns once the steps are exhausted.
END = object()


class AsyncSteps(Generic[T]):
    """One turn's steps, advanced from the event loop: `await next()` until it returns END, then (always,
    in a `finally`) `await close()`.

    The steps run in one contextvars context of their own (structlog's bound fields follow them from
    thread to thread), never on two threads at once, and are closed only between stretches and after any
    pass they wait for has finished: a turn cancelled mid-pass ends as it would in a thread of its own.
    """

    def __init__(self, steps: Iterator[T | PassWait], executor: Executor) -> None:
        self._steps = steps
        self._executor = executor
        self._context = contextvars.copy_context()
        self._done = False
        # The stretch or pass in flight when the caller was cancelled: `close` waits it out first.
        self._in_flight: Future | None = None

    def _advance(self) -> object:
        return next(self._steps, END)

    async def next(self) -> T | object:
        """The next event, or END.

        Raises:
            whatever the steps raise; asyncio.CancelledError when the caller is cancelled (the stretch or
            pass in flight still finishes, and `close` waits for it).
        """
        if self._done:
            return END
        while True:
            item = await self._await(self._executor.submit(self._context.run, self._advance))
            if isinstance(item, PassWait):
                await self._await(item.future, reraise=False)
                continue
            if item is END:
                self._done = True
            return item

    async def _await(self, future: Future, *, reraise: bool = True) -> object:
        """`future`'s result, awaited without cancelling it: a cancel of the caller leaves it running and
        remembered for `close`. A pass's error (`reraise` False) reaches the steps when they resume."""
        self._in_flight = future
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            raise
        except BaseException:
            if reraise:
                self._done = True
                raise
            return None
        finally:
            if future.done():
                self._in_flight = None

    async def close(self) -> None:
        """Close the steps if they did not finish (GeneratorExit reaches them, as when a threaded front
        door's client goes away), after whatever was in flight; safe to call more than once."""
        pending, self._in_flight = self._in_flight, None
        if self._done and pending is None:
            return
        finished, self._done = self._done, True
        closing = self._executor.submit(self._close_after, pending, finished)
        # The close runs to its end on its thread even when this caller is cancelled again (server stop).
        await asyncio.shield(asyncio.wrap_future(closing))

    def _close_after(self, pending: Future | None, finished: bool) -> None:
        # Waited for outside the steps' context: the stretch in flight is still inside it (a context can
        # be entered by one thread at a time).
        if pending is not None:
            wait_all([pending])
        close = getattr(self._steps, "close", None)
        if not finished and close is not None:
            self._context.run(close)
