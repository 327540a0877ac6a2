"""The canonical per-turn log line, and the logging set-up that entry points call once.

Importing this module configures nothing (STYLE rule 15); `configure_logging` is for entry points.
"""

from __future__ import annotations

import logging
import sys

import structlog

from orchestrator.planner import Plan

__all__ = ["log_turn_decision", "configure_logging", "TURN_EVENT"]

TURN_EVENT = "turn_completed"
log = structlog.get_logger(__name__)


def log_turn_decision(
    *,
    session_id: str,
    tenant: str,
    turn_index: int,
    request_id: str,
    plan: Plan,
    outcome: str,
    finish_reason: str | None,
    ttft_s: float | None,
    decode_tokens_per_s: float | None,
    total_s: float | None,
    generated_tokens: int,
    persisted: bool,
) -> None:
    """Emit the one canonical line of a turn: ids, path, reason, counts and timings as fields.

    Args:
        finish_reason: "length", "stop" or "aborted"; None for a turn that failed before it finished.
        ttft_s: time to the first streamed token (also of an aborted turn); None when none was streamed.
    """
    c = plan.counts
    log.info(
        TURN_EVENT,
        session_id=session_id,
        tenant=tenant,
        turn=turn_index,
        request_id=request_id,
        path=str(plan.path),
        model=plan.model,
        source_model=plan.source_model,
        mapper_id=plan.mapper_id,
        reason=plan.reason,
        cached=c.cached,
        replayed_encoder=c.replayed_encoder,
        replayed_decoder=c.replayed_decoder,
        prefilled=c.prefilled,
        mapped=c.mapped,
        generated=generated_tokens,
        ttft_s=ttft_s,
        decode_tokens_per_s=decode_tokens_per_s,
        total_s=total_s,
        persisted=persisted,
        outcome=outcome,
        finish_reason=finish_reason,
    )


def configure_logging(*, json: bool | None = None, level: int = logging.INFO) -> None:
    """Configure structlog once for the process: JSON lines off a TTY, readable lines on one.

    Binds contextvars (session_id, turn_id, request_id bound at the RPC entry) into every line.
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
