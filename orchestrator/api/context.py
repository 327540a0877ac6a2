"""Everything the servicers share: settings, database, audit sink, auth, running turns, metrics, stubs.

Built once per server by `build_context`; knows nothing of gRPC's server object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.api.auth import Authenticator
from orchestrator.api.convert import Converter
from orchestrator.api.metrics import ServiceMetrics
from orchestrator.api.running_turns import RunningTurns
from orchestrator.api.stubs import Stubs, load_stubs
from orchestrator.api.turn_types import TurnHandler
from orchestrator.db import (
    EffectivePolicy,
    Purger,
    SegmentRepository,
    SqlAuditSink,
    StorePurger,
    make_engine,
    make_session_factory,
    serializable_factory,
    upgrade,
)
from orchestrator.settings import Settings

__all__ = ["ServiceContext", "PoolStats", "build_context"]


@dataclass(frozen=True, kw_only=True)
class PoolStats:
    bytes_used: int
    budget_bytes: int
    entries: int


@dataclass(kw_only=True)
class ServiceContext:
    """Shared service state. `turn_handler`, `pool_stats` and `on_policy_change` are wired by whoever
    owns the turn engine, the pool and the store."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    serializable: sessionmaker[Session]
    audit: SqlAuditSink
    auth: Authenticator
    running: RunningTurns
    metrics: ServiceMetrics
    stubs: Stubs
    convert: Converter
    purger: Purger
    node: str
    turn_handler: TurnHandler | None = None
    pool_stats: Callable[[], PoolStats] | None = None
    # Called after a policy change commits (e.g. to apply it to the store: GlobalKVStore.set_policy).
    on_policy_change: Callable[[EffectivePolicy, str], None] | None = None
    # Names of the models this node serves (None: not known here, nothing is checked at CreateSession).
    served_models: tuple[str, ...] | None = None

    def close(self) -> None:
        self.engine.dispose()


def build_context(
    settings: Settings,
    *,
    migrate: bool = True,
    store: StorePurger | None = None,
    turn_handler: TurnHandler | None = None,
    pool_stats: Callable[[], PoolStats] | None = None,
    metrics: ServiceMetrics | None = None,
) -> ServiceContext:
    """Open the registry (migrating it to head unless `migrate=False`) and assemble the shared state."""
    url = settings.resolved_database_url
    if migrate:
        upgrade(url)
    engine = make_engine(url)
    serializable = serializable_factory(engine)
    audit = SqlAuditSink(engine)
    stubs = load_stubs()
    ctx = ServiceContext(
        settings=settings,
        engine=engine,
        sessions=make_session_factory(engine),
        serializable=serializable,
        audit=audit,
        auth=Authenticator(tenant_tokens=settings.tenant_tokens, admin_token=settings.admin_token),
        running=RunningTurns(),
        metrics=metrics if metrics is not None else ServiceMetrics(),
        stubs=stubs,
        convert=Converter(stubs),
        purger=Purger(serializable, audit, store),
        node=settings.resolved_node_name,
        turn_handler=turn_handler,
        pool_stats=pool_stats,
    )
    _wire_gauges(ctx)
    return ctx


def _wire_gauges(ctx: ServiceContext) -> None:
    """Gauges read at scrape time: stored bytes from the registry, pool occupancy from its owner."""
    m = ctx.metrics

    def stored_bytes() -> float:
        with ctx.sessions() as s:
            return float(SegmentRepository(s).totals().bytes)

    m.stored_bytes.set_function(stored_bytes)
    m.pool_budget_bytes.set(ctx.settings.pool_budget_bytes)
    m.running_turns.set_function(lambda: float(len(ctx.running)))
    if ctx.pool_stats is not None:
        pool = ctx.pool_stats
        m.pool_bytes.set_function(lambda: float(pool().bytes_used))
        m.pool_entries.set_function(lambda: float(pool().entries))
        m.pool_budget_bytes.set_function(lambda: float(pool().budget_bytes))
