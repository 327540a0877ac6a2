"""The one way a turn is submitted, for both front doors (gRPC Sessions.Turn and the HTTP API): ownership and
state checks, the running-turn registration that refuses a concurrent turn, the event-order contract, the
end of a turn stopped by a cancel, and its metrics and canonical log line; also the shared creation of a
session and the validation of generation parameters.

Knows nothing of protobuf or HTTP: it takes and yields the domain types of `turn_types`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import structlog

from orchestrator.api.context import ServiceContext
from orchestrator.api.errors import (
    CancelledError,
    InvalidRequestError,
    NotFoundError,
    PreconditionError,
    ResourceExhaustedError,
    check_name_length,
)
from orchestrator.api.running_turns import TurnHandle
from orchestrator.api.turn_log import log_turn_decision
from orchestrator.api.turn_types import (
    FinishReason,
    GenerationSpec,
    PlanEvent,
    TokenChunkEvent,
    TurnEvent,
    TurnInput,
    TurnStatsEvent,
)
from orchestrator.db import (
    PolicyRepository,
    SessionRepository,
    TenantRepository,
    run_serializable,
    run_serializable_connection,
)
from orchestrator.db.models import SessionRow, SessionStatus, utcnow

# The module, not the package root: the scheduler package imports orchestrator.api (its errors), and the
# api package imports this module while it initializes.
from orchestrator.scheduler.pass_wait import PassWait, wait_inline

__all__ = ["create_session", "generation_spec", "owned_session", "run_turn", "turn_steps"]

T = TypeVar("T")


def owned_session(s: Any, session_id: str, tenant_id: str) -> SessionRow:
    """The session row, when `tenant_id` owns it (another tenant's session reads as absent).

    Raises:
        InvalidRequestError: no session id, or one past the name limit.
        NotFoundError: no such session of this tenant.
    """
    _check_session_id(session_id)
    row = SessionRepository(s).get(session_id, tenant_id=tenant_id)
    if row is None:
        raise NotFoundError(f"session {session_id} not found")
    return row


def _check_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidRequestError("session_id is required", field="session_id")
    check_name_length("session_id", session_id)


def create_session(
    ctx: ServiceContext,
    *,
    tenant_id: str,
    model: str,
    retention_hint_s: float | None,
    convert: Callable[[SessionRow], T],
    driver: bool = True,
) -> tuple[T, float]:
    """Create a session of the tenant (registering the tenant on its first session) in one serializable
    transaction; returns `convert(row)` (called inside it) and the granted retention.

    Args:
        driver: on SQLite, run the statements through the driver (`SessionCreate`, on a Connection
            without an ORM Session); False runs the repositories in a Session, its twin (tests compare
            the two). Other databases always take the Session path.

    Raises:
        ResourceExhaustedError: the tenant holds `max_sessions_per_tenant` sessions (reason SESSION_LIMIT).
    """
    settings = ctx.settings

    def refuse_at_limit(tenant: str, count: int) -> None:
        if count >= settings.max_sessions_per_tenant:
            raise ResourceExhaustedError(
                f"tenant {tenant} has {settings.max_sessions_per_tenant} sessions, the limit",
                reason="SESSION_LIMIT",
                retry_after_s=60.0,
            )

    def work(s: Any) -> tuple[T, float, str]:
        tenant = TenantRepository(s).ensure(tenant_id)
        repo = SessionRepository(s)
        refuse_at_limit(tenant.id, repo.count(tenant_id=tenant.id))
        policy = PolicyRepository(s).effective(
            tenant.id,
            default_floor_s=settings.retention_floor_s,
            default_ceiling_s=settings.retention_ceiling_s,
        )
        granted = policy.clip_retention(retention_hint_s)
        row = repo.create(
            tenant_id=tenant.id,
            model=model,
            retention_s=granted,
            retention_hint_s=retention_hint_s,
            node=ctx.node,
            region=settings.region,
        )
        return convert(row), granted, row.id

    creator = ctx.session_create if driver else None

    def work_on_driver(conn: Any) -> tuple[T, float, str]:
        assert creator is not None
        raw = conn.connection.driver_connection
        creator.ensure_tenant(raw, tenant_id)
        refuse_at_limit(tenant_id, creator.count(raw, tenant_id))
        policy = creator.effective_policy(
            raw,
            tenant_id,
            default_floor_s=settings.retention_floor_s,
            default_ceiling_s=settings.retention_ceiling_s,
        )
        granted = policy.clip_retention(retention_hint_s)
        row = creator.create(
            raw,
            tenant_id=tenant_id,
            model=model,
            retention_s=granted,
            retention_hint_s=retention_hint_s,
            node=ctx.node,
            region=settings.region,
            clock=utcnow,
        )
        return convert(row), granted, row.id

    if creator is not None:
        converted, granted, session_id = run_serializable_connection(ctx.writer, work_on_driver)
    else:
        converted, granted, session_id = run_serializable(ctx.serializable, work)
    ctx.owners.remember(session_id, tenant_id)
    return converted, granted


def generation_spec(
    ctx: ServiceContext,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop_token_ids: tuple[int, ...],
    field: str = "generation.max_new_tokens",
) -> GenerationSpec:
    """Validated generation parameters; `max_new_tokens` 0 means the default (256, within the limit).

    Raises:
        InvalidRequestError: past the node's `max_new_tokens`, or parameters GenerationSpec refuses.
    """
    limit = ctx.settings.max_new_tokens
    max_new = max_new_tokens or min(256, limit)
    if max_new > limit:
        raise InvalidRequestError(f"max_new_tokens={max_new} exceeds the limit {limit}", field=field)
    try:
        return GenerationSpec(
            max_new_tokens=max_new,
            temperature=temperature,
            # 0 is proto3's "unset"; anything else (NaN, negative, > 1) reaches the validation.
            top_p=top_p if top_p != 0 else 1.0,
            top_k=top_k,
            seed=seed,
            stop_token_ids=stop_token_ids,
        )
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from exc


def run_turn(
    ctx: ServiceContext, turn: TurnInput, *, on_start: Callable[[TurnHandle], None] | None = None
) -> Iterator[TurnEvent]:
    """`turn_steps`, this thread waiting out each forward pass: the turn's events only."""
    return wait_inline(turn_steps(ctx, turn, on_start=on_start))


def turn_steps(
    ctx: ServiceContext, turn: TurnInput, *, on_start: Callable[[TurnHandle], None] | None = None
) -> Iterator[TurnEvent | PassWait]:
    """Run one turn: yields its PlanEvent, TokenChunkEvents and TurnStatsEvent (the TurnHandler contract),
    and, between them, a PassWait wherever the turn waits for a forward pass (a handler with
    `turn_steps`); the caller resumes the steps once that pass is done (`wait_inline`, or the asyncio
    server's `async_steps`).

    Args:
        on_start: called with the turn's handle once it is registered (a front door hooks its client's
            disconnect to `handle.cancel` there).

    A cancel after the plan ends the stream with an ABORTED stats event; closing the generator (a client
    that went away) counts the turn as aborted. Either way the running-turn slot is released and the
    turn's metrics and log line are written.

    Raises:
        NotFoundError, InvalidRequestError: the session is not the tenant's.
        PreconditionError: the session is closed (SESSION_CLOSED) or runs a turn (TURN_RUNNING). A
            session whose owner is remembered (`SessionOwners`) and that was closed or deleted by another
            node is refused by the handler's own read of it, after the turn registered.
        CancelledError: cancelled before the plan went out.
    """
    _check_session_id(turn.session_id)
    if not ctx.owners.owned_by(turn.session_id, turn.tenant_id):
        # A Core row (what `owned_session` checks, without an ORM object). Once the owner is known the
        # check reads nothing: the engine's own read of the session checks existence and status again.
        with ctx.sessions() as s:
            row = SessionRepository(s).facts(turn.session_id, tenant_id=turn.tenant_id)
        if row is None:
            raise NotFoundError(f"session {turn.session_id} not found")
        if row.status != SessionStatus.OPEN:
            raise PreconditionError(f"session {row.id} is closed", reason="SESSION_CLOSED")
        ctx.owners.remember(row.id, row.tenant_id)
    handler = ctx.turn_handler
    if handler is None:
        raise NotImplementedError("this server has no turn engine configured")
    handle = ctx.running.start(turn.session_id, turn.request_id, turn.tenant_id)
    structlog.contextvars.bind_contextvars(session_id=turn.session_id, request_id=turn.request_id)
    started = time.perf_counter()
    plan_event: PlanEvent | None = None
    outcome = "failed"
    stats: TurnStatsEvent | None = None
    generated = 0
    # Seconds from `started` at which each token chunk was streamed (TTFT and inter-token latency).
    chunk_at: list[float] = []
    try:
        if on_start is not None:
            on_start(handle)
        as_steps = getattr(handler, "turn_steps", None)
        for event in as_steps(turn, handle) if as_steps is not None else handler.run_turn(turn, handle):
            if isinstance(event, PassWait):
                yield event
                continue
            # The stream contract (plan first, stats last) is what callers parse; enforce it here.
            if (plan_event is None) != isinstance(event, PlanEvent) or stats is not None:
                raise RuntimeError(f"turn engine broke the event order with {type(event).__name__}")
            if isinstance(event, PlanEvent):
                plan_event = event
                structlog.contextvars.bind_contextvars(turn_id=event.turn_index)
            elif isinstance(event, TokenChunkEvent):
                generated += len(event.ids)
                chunk_at.append(time.perf_counter() - started)
            else:
                stats = event
            yield event
        if stats is None:
            raise RuntimeError("turn engine ended the stream without its stats")
        outcome = "aborted" if stats.finish_reason == FinishReason.ABORTED else "done"
    except CancelledError:
        outcome = "aborted"
        if plan_event is None:
            raise
        # A handler that stops by raising after its plan: the stream still ends with the turn's record
        # (ABORTED, nothing kept), as the TurnHandler contract promises callers.
        stats = TurnStatsEvent(
            turn_index=plan_event.turn_index,
            ttft_s=chunk_at[0] if chunk_at else 0.0,
            decode_tokens_per_s=0.0,
            counts=plan_event.plan.counts,
            generated_tokens=generated,
            finish_reason=FinishReason.ABORTED,
            total_s=time.perf_counter() - started,
            persisted=False,
            kept=False,
        )
        yield stats
    except GeneratorExit:
        # The client went away mid-stream (its front door closes the generator).
        outcome = "aborted"
        handle.cancel("client went away")
        raise
    finally:
        ctx.running.finish(handle)
        if plan_event is not None:
            _report(ctx, turn, plan_event, stats, outcome, generated, time.perf_counter() - started, chunk_at)
        structlog.contextvars.unbind_contextvars("session_id", "request_id", "turn_id")


def _report(
    ctx: ServiceContext,
    turn: TurnInput,
    plan_event: PlanEvent,
    stats: TurnStatsEvent | None,
    outcome: str,
    generated: int,
    elapsed_s: float,
    chunk_at: list[float],
) -> None:
    """Metrics and the canonical log line of a turn that got as far as its plan.

    Args:
        chunk_at: seconds after the turn was taken at which each token chunk was streamed; the first is
            the TTFT of a turn that ended without stats (aborted, failed).
    """
    plan = plan_event.plan
    m = ctx.metrics
    path, model = str(plan.path), plan.model
    m.child(m.turns, model=model, path=path, outcome=outcome).inc()
    for kind in ("cached", "replayed_encoder", "replayed_decoder", "prefilled", "mapped"):
        m.child(m.turn_tokens, model=model, kind=kind).inc(getattr(plan.counts, kind))
    m.child(m.turn_latency, model=model, path=path).observe(stats.total_s if stats else elapsed_s)
    ttft = stats.ttft_s if stats is not None else (chunk_at[0] if chunk_at else None)
    if ttft is not None:
        m.child(m.ttft, model=model, path=path).observe(ttft)
    m.child(m.generated_tokens, model=model).inc(generated)
    itl = m.child(m.inter_token, model=model)
    for before, after in zip(chunk_at, chunk_at[1:], strict=False):
        itl.observe(after - before)
    # Residency (plan.persist False) and an abort that keeps nothing are not failures; a refused or failed
    # store write is.
    if stats is not None and stats.kept and plan.persist and not stats.persisted:
        m.child(m.persist_failures, model=model).inc()
    if stats is not None:
        finish: str | None = str(stats.finish_reason)
    else:
        finish = str(FinishReason.ABORTED) if outcome == "aborted" else None
    log_turn_decision(
        session_id=turn.session_id,
        tenant=turn.tenant_id,
        turn_index=plan_event.turn_index,
        request_id=turn.request_id,
        plan=plan,
        outcome=outcome,
        finish_reason=finish,
        ttft_s=ttft,
        decode_tokens_per_s=stats.decode_tokens_per_s if stats else None,
        total_s=stats.total_s if stats else elapsed_s,
        generated_tokens=generated,
        persisted=stats.persisted if stats else False,
    )
