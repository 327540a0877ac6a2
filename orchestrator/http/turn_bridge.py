"""A turn run for an asyncio caller: the request's preparation (registry and tokenizer work) and then the
shared `run_turn` generator run in one worker thread (they block; one thread hop per request, not two) and
hand their results to the event loop through a queue.

Knows nothing of HTTP. `cancel` reaches the turn through its `TurnHandle` (the scheduler's cancellation, as
a gRPC client's cancel does); a cancel that comes before the turn is registered takes effect as it is.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Generic, TypeVar

from orchestrator.api import ServiceContext, TurnEvent, TurnHandle, TurnInput
from orchestrator.api.turn_runner import run_turn

__all__ = ["TurnBridge"]


@dataclass(frozen=True)
class _Failed:
    exc: BaseException


@dataclass(frozen=True)
class _Prepared:
    value: object


_END = object()
P = TypeVar("P")


class TurnBridge(Generic[P]):
    """One request, started on `executor`: `prepare()` gives (what the caller keeps, the turn to run); await
    `prepared()`, then iterate `events()`, on the event loop that created it."""

    def __init__(
        self, ctx: ServiceContext, prepare: Callable[[], tuple[P, TurnInput]], executor: Executor
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._lock = threading.Lock()
        self._handle: TurnHandle | None = None
        self._cancel_reason: str | None = None
        self._future = executor.submit(self._work, ctx, prepare)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            # The loop is closed (server shut down): nobody reads the rest of this turn.
            pass

    def _on_start(self, handle: TurnHandle) -> None:
        with self._lock:
            self._handle = handle
            reason = self._cancel_reason
        if reason is not None:
            handle.cancel(reason)

    def _work(self, ctx: ServiceContext, prepare: Callable[[], tuple[P, TurnInput]]) -> None:
        try:
            value, turn = prepare()
            self._put(_Prepared(value))
            for event in run_turn(ctx, turn, on_start=self._on_start):
                self._put(event)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which maps it to a status
            self._put(_Failed(exc))
        finally:
            self._put(_END)

    def cancel(self, reason: str) -> None:
        """Stop the turn at its next step (nothing of it is kept); idempotent."""
        with self._lock:
            handle = self._handle
            if handle is None and self._cancel_reason is None:
                self._cancel_reason = reason
        if handle is not None:
            handle.cancel(reason)

    async def prepared(self) -> P:
        """What `prepare` returned; re-raises its exception."""
        item = await self._queue.get()
        if isinstance(item, _Failed):
            raise item.exc
        assert isinstance(item, _Prepared), f"the bridge began with {item!r}"
        return item.value  # type: ignore[return-value]

    async def events(self) -> AsyncIterator[TurnEvent]:
        """The turn's events in order; re-raises the exception that ended it."""
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.exc
            yield item  # type: ignore[misc]
