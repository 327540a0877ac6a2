"""The Sessions service: create, turn (delegated to the turn engine), fork, get, list, close, delete, abort.

Converts messages to domain objects at entry; a tenant sees only its own sessions (others read as
NOT_FOUND, so that ids do not leak across tenants).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import Any

import grpc
import structlog

from orchestrator.api.async_steps import END, AsyncSteps
from orchestrator.api.context import ServiceContext
from orchestrator.api.errors import (
    InvalidRequestError,
    NotFoundError,
    ResourceExhaustedError,
    check_name_length,
    model_not_served,
)
from orchestrator.api.running_turns import TurnHandle
from orchestrator.api.status_table import async_errors, stream_errors, unary_errors
from orchestrator.api.turn_runner import create_session, generation_spec, owned_session, run_turn, turn_steps
from orchestrator.api.turn_types import TurnEvent, TurnInput
from orchestrator.db import SessionRepository, run_serializable

__all__ = ["AsyncSessionsServicer", "SessionsServicer", "servicer_class"]

log = structlog.get_logger(__name__)
_DEFAULT_PAGE = 50
_NO_DEADLINE_S = 1e9
_MAX_PAGE = 1000


def _page_token(row: Any) -> str:
    # The cursor is the last row's position (created_at, id), opaque to the caller.
    return base64.urlsafe_b64encode(f"{row.created_at.isoformat()}|{row.id}".encode()).decode()


def _after(token: str) -> tuple[dt.datetime, str] | None:
    if not token:
        return None
    try:
        when, _, session_id = base64.urlsafe_b64decode(token.encode()).decode().partition("|")
        return dt.datetime.fromisoformat(when), session_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"bad page_token {token!r}", field="page_token") from exc


def servicer_class(ctx: ServiceContext, *, asyncio_server: bool = False) -> type:
    """The servicer class, derived from the generated base so unimplemented methods say UNIMPLEMENTED.

    Args:
        asyncio_server: the class for the asyncio server (`AsyncSessionsServicer`: Turn a coroutine).
    """
    base = ctx.stubs.sessions_grpc.SessionsServicer
    if asyncio_server:
        return type("SessionsServicer", (AsyncSessionsServicer, base), {})
    return type("SessionsServicer", (SessionsServicer, base), {})


class SessionsServicer:
    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._pb = ctx.stubs.sessions

    def _get_owned(self, s: Any, session_id: str, tenant_id: str) -> Any:
        return owned_session(s, session_id, tenant_id)

    def _check_served(self, model: str) -> None:
        """A model name this node serves (when it knows its models): refused at once, not at the first
        turn, and never echoed past its length limit."""
        check_name_length("model", model)
        served = self._ctx.served_models
        if served is not None and model not in served:
            raise model_not_served(model, served)

    def _check_owned(self, session_id: str, tenant_id: str) -> None:
        """NotFoundError unless `tenant_id` owns the session (read-only; before acting on its turn)."""
        with self._ctx.sessions() as s:
            self._get_owned(s, session_id, tenant_id)

    @unary_errors
    def CreateSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)
        if not request.model:
            raise InvalidRequestError("model is required", field="model")
        self._check_served(request.model)
        hint = request.retention.retention_s if request.retention.HasField("retention_s") else None
        if hint is not None and not hint > 0:
            raise InvalidRequestError(f"retention_s={hint} must be positive", field="retention.retention_s")

        session, granted = create_session(
            self._ctx,
            tenant_id=caller.tenant_id,
            model=request.model,
            retention_hint_s=hint,
            convert=self._ctx.convert.session,
        )
        c = self._ctx.stubs.common
        if hint is None:
            outcome = c.RETENTION_OUTCOME_DEFAULTED
        else:
            outcome = c.RETENTION_OUTCOME_ACCEPTED if granted == hint else c.RETENTION_OUTCOME_CLIPPED
        response = self._pb.CreateSessionResponse(session=session, retention_outcome=outcome)
        if hint is not None:
            response.requested_retention_s = hint
        log.info(
            "session_created", session_id=session.session_id, tenant=caller.tenant_id, model=request.model
        )
        return response

    @unary_errors
    def GetSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)
        with self._ctx.sessions() as s:
            return self._ctx.convert.session(self._get_owned(s, request.session_id, caller.tenant_id))

    @unary_errors
    def ListSessions(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)
        size = request.page_size or _DEFAULT_PAGE
        if size > _MAX_PAGE:
            raise InvalidRequestError(f"page_size={size} exceeds {_MAX_PAGE}", field="page_size")
        after = _after(request.page_token)
        with self._ctx.sessions() as s:
            rows = SessionRepository(s).list(
                tenant_id=caller.tenant_id,
                limit=size + 1,
                after=after,
                include_closed=not request.open_only,
            )
            more = len(rows) > size
            rows = rows[:size]
            return self._pb.ListSessionsResponse(
                sessions=[self._ctx.convert.session(r) for r in rows],
                next_page_token=_page_token(rows[-1]) if more else "",
            )

    @unary_errors
    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)

        def work(s: Any) -> Any:
            row = self._get_owned(s, request.session_id, caller.tenant_id)
            SessionRepository(s).close(row)
            return self._ctx.convert.session(row)

        # Ownership first: another tenant naming this id gets NOT_FOUND and must not cancel its turn.
        self._check_owned(request.session_id, caller.tenant_id)
        # The next turn's ownership check reads the registry again (and finds the session closed).
        self._ctx.owners.forget(request.session_id)
        self._ctx.running.abort(request.session_id, "session closed")
        return run_serializable(self._ctx.serializable, work)

    @unary_errors
    def ForkSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)

        def work(s: Any) -> Any:
            parent = self._get_owned(s, request.session_id, caller.tenant_id)
            if request.at_turn > parent.turn_count:
                raise InvalidRequestError(
                    f"at_turn={request.at_turn} is past session {parent.id}'s {parent.turn_count} turns",
                    field="at_turn",
                )
            child = SessionRepository(s).fork(parent, at_turn=request.at_turn)
            return self._ctx.convert.session(child)

        session = run_serializable(self._ctx.serializable, work)
        log.info(
            "session_forked",
            session_id=session.session_id,
            parent=request.session_id,
            at_turn=request.at_turn,
        )
        return self._pb.ForkSessionResponse(session=session)

    @unary_errors
    def DeleteSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)
        self._check_owned(request.session_id, caller.tenant_id)
        self._ctx.running.abort(request.session_id, "session deleted")
        outcome = self._ctx.purger.purge_session(
            request.session_id, tenant_id=caller.tenant_id, actor=caller.actor, reason="tenant_request"
        )
        self._ctx.owners.forget(request.session_id)
        if outcome is None:
            raise NotFoundError(f"session {request.session_id} not found")
        return self._pb.DeleteSessionResponse(
            segments_deleted=outcome.segments_deleted, bytes_deleted=outcome.bytes_deleted
        )

    @unary_errors
    def Abort(self, request: Any, context: grpc.ServicerContext) -> Any:
        caller = self._ctx.auth.tenant(context)
        if not request.session_id and not request.request_id:
            raise InvalidRequestError("Abort needs session_id or request_id", field="session_id")
        check_name_length("request_id", request.request_id)
        if request.session_id:
            # Another tenant's session reads as absent; it must not learn whether a turn runs there.
            self._check_owned(request.session_id, caller.tenant_id)
        handle = self._ctx.running.find(
            tenant_id=caller.tenant_id, session_id=request.session_id, request_id=request.request_id
        )
        if handle is not None:
            handle.cancel(request.reason or "aborted by caller", keep_partial=request.keep_partial)
        log.info(
            "turn_abort_requested",
            session_id=request.session_id or (handle.session_id if handle else ""),
            abort_request_id=request.request_id,
            keep_partial=request.keep_partial,
            aborted=handle is not None,
        )
        if handle is None:
            return self._pb.AbortResponse(aborted=False)
        return self._pb.AbortResponse(
            aborted=True, session_id=handle.session_id, request_id=handle.request_id
        )

    def _turn_input(self, request: Any, tenant_id: str, remaining_s: float | None = None) -> TurnInput:
        settings = self._ctx.settings
        which = request.WhichOneof("input")
        tokens = tuple(request.tokens.ids) if which == "tokens" else None
        text = request.text if which == "text" else None
        if which is None or not (tokens or text):
            raise InvalidRequestError(
                f"empty turn for session {request.session_id}: no tokens and no text", field="input"
            )
        if tokens is not None and len(tokens) > settings.max_turn_tokens:
            raise ResourceExhaustedError(
                f"turn of {len(tokens)} tokens exceeds the limit {settings.max_turn_tokens}",
                reason="REQUEST_TOO_LARGE",
                field="tokens",
            )
        if text is not None and len(text.encode()) > settings.max_turn_tokens * 4:
            raise ResourceExhaustedError(
                f"turn text of {len(text.encode())} bytes exceeds the limit {settings.max_turn_tokens * 4}",
                reason="REQUEST_TOO_LARGE",
                field="text",
            )
        if request.model:
            self._check_served(request.model)
        check_name_length("request_id", request.request_id)
        g = request.generation
        spec = generation_spec(
            self._ctx,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            seed=g.seed if g.HasField("seed") else None,
            stop_token_ids=tuple(g.stop_token_ids),
        )
        return TurnInput(
            session_id=request.session_id,
            tenant_id=tenant_id,
            request_id=request.request_id or uuid.uuid4().hex,
            tokens=tokens,
            text=text,
            generation=spec,
            model=request.model or None,
            deadline_monotonic=None if remaining_s is None else time.monotonic() + remaining_s,
        )

    @stream_errors
    def Turn(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        caller = self._ctx.auth.tenant(context)
        remaining = context.time_remaining()
        # Without a client deadline gRPC reports a practically infinite remaining time.
        turn = self._turn_input(request, caller.tenant_id, remaining if remaining < _NO_DEADLINE_S else None)
        convert = self._ctx.convert

        def on_start(handle: TurnHandle) -> None:
            # gRPC runs this when the call ends for any reason, a finished turn's too (on its poller
            # thread, which every call's messages wait for): a finished turn has nothing to cancel, and
            # the cancel's Event.set was about 1% of the interpreter lock's time at 64 sessions
            context.add_callback(lambda: handle.finished or handle.cancel("client cancelled"))

        for event in run_turn(self._ctx, turn, on_start=on_start):
            yield convert.turn_event(event, request_id=turn.request_id)


class AsyncSessionsServicer(SessionsServicer):
    """The Sessions service of the asyncio server. Turn is a coroutine on the event loop: the turn's
    blocking stretches run on `executor` and its waits for the scheduler are awaited (`AsyncSteps`), so a
    waiting turn holds no thread. The other methods are SessionsServicer's, run on worker threads by the
    server's interceptor (`aio_interceptor.py`)."""

    def __init__(self, ctx: ServiceContext, executor: Executor) -> None:
        super().__init__(ctx)
        self._executor = executor

    @async_errors
    async def Turn(self, request: Any, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        # Cheap checks on the loop (no registry access): auth, limits, generation parameters.
        caller = self._ctx.auth.tenant(context)
        turn = self._turn_input(request, caller.tenant_id, context.time_remaining())
        convert = self._ctx.convert
        # Set on a worker thread once the turn is registered. grpc.aio runs a call's done callbacks only
        # after this coroutine has returned; it cancels this task instead when the client goes away, the
        # deadline passes or the server stops, so that is where the turn learns of it.
        started: list[TurnHandle] = []
        steps: AsyncSteps[TurnEvent] = AsyncSteps(
            turn_steps(self._ctx, turn, on_start=started.append), self._executor
        )
        try:
            while (event := await steps.next()) is not END:
                await context.write(convert.turn_event(event, request_id=turn.request_id))
        except asyncio.CancelledError:
            # The turn stops at its next step, as the thread-pool server's termination callback makes it,
            # before `close` waits out its stretch in flight.
            for handle in started:
                handle.cancel("client cancelled")
            raise
        finally:
            await steps.close()
