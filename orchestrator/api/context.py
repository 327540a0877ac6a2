"""Everything the servicers share: settings, database, audit sink, auth, running turns, metrics, stubs.

Built once per server by `build_context`; knows nothing of gRPC's server object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.api.auth import Authenticator
from orchestrator.api.convert import Converter
from orchestrator.api.metrics import ServiceMetrics, StorageCounts
from orchestrator.api.model_catalog import ModelCatalog
from orchestrator.api.running_turns import RunningTurns
from orchestrator.api.session_owners import SessionOwners
from orchestrator.api.stubs import Stubs, load_stubs
from orchestrator.api.turn_types import TurnHandler
from orchestrator.db import (
    AuditChecker,
    EffectivePolicy,
    Purger,
    SegmentRepository,
    SessionCreate,
    SqlAuditSink,
    StorePurger,
    make_engine,
    make_session_factory,
    serializable_engine,
    serializable_factory,
    upgrade,
)
from orchestrator.numerics_env import resolve_cpu_path
from orchestrator.settings import Settings
from storage import StoreHealth, StoreStats

if TYPE_CHECKING:
    from orchestrator.jobs import FitJobService

__all__ = ["ServiceContext", "PoolStats", "build_context"]


@dataclass(frozen=True, kw_only=True)
class PoolStats:
    """The window pool now, and its cumulative drops since start (for the metrics)."""

    bytes_used: int
    budget_bytes: int
    entries: int
    # Entries dropped idle past the TTL, and least recently used ones dropped to fit the budget.
    expired: int = 0
    evicted_lru: int = 0
    # Puts refused because the value alone exceeds the budget.
    refused: int = 0


@dataclass(kw_only=True)
class ServiceContext:
    """Shared service state. `turn_handler`, `pool_stats`, `store_stats`, `on_policy_change` and
    `served_models` are wired by whoever owns the turn engine, the pool and the store."""

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
    # Owners the registry named, so that a turn's ownership check before it runs reads no SQL again.
    owners: SessionOwners = field(default_factory=SessionOwners)
    # Called inside a policy change's transaction, before it commits: raises ValueError for a policy
    # the store would refuse, so that SQL never holds one (the store's validation, no write).
    check_policy: Callable[[EffectivePolicy], None] | None = None
    # Called after a policy change commits (e.g. to apply it to the store: GlobalKVStore.set_policy).
    on_policy_change: Callable[[EffectivePolicy, str], None] | None = None
    # Names of the models this node serves (None: not known here, nothing is checked at CreateSession).
    served_models: tuple[str, ...] | None = None
    # The store's node-wide counters (read at scrape time for the eviction, expiry and refusal counters).
    store_stats: Callable[[], StoreStats] | None = None
    # The store's health and a one-batch write probe, behind the `kvresume.store` health service and
    # the kvresume_store_degraded gauge (None: the service reports SERVING, no store is attached).
    store_health: Callable[[], StoreHealth] | None = None
    store_probe: Callable[[], bool] | None = None
    # The served models for the Models service (None: the service answers UNIMPLEMENTED).
    model_catalog: ModelCatalog | None = None
    # The node's mapper fitting jobs (orchestrator.jobs.FitJobService; None: the job RPCs answer
    # UNIMPLEMENTED).
    fit_jobs: FitJobService | None = None
    # The whole audit check (both chains, their agreement, the anchors); None: the SQL chains alone.
    audit_checker: AuditChecker | None = None

    @functools.cached_property
    def writer(self) -> Engine:
        """`engine` as a serialisable writer (`serializable_engine`), for `run_serializable_connection`."""
        return serializable_engine(self.engine)

    @functools.cached_property
    def session_create(self) -> SessionCreate | None:
        """CreateSession's statements compiled for the driver on SQLite (None elsewhere: the ORM path)."""
        return SessionCreate(self.engine.dialect) if self.engine.dialect.name == "sqlite" else None

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


def _storage_counts(ctx: ServiceContext) -> StorageCounts:
    """The pool's and the store's cumulative counts, from whichever of the two is wired by now."""
    pool = ctx.pool_stats() if ctx.pool_stats is not None else None
    store = ctx.store_stats() if ctx.store_stats is not None else None
    return StorageCounts(
        pool_expired=pool.expired if pool is not None else None,
        pool_evicted_lru=pool.evicted_lru if pool is not None else None,
        pool_refused=pool.refused if pool is not None else None,
        store_expired_chunks=store.expired_chunks if store is not None else None,
        store_evicted_chunks=store.evicted_chunks if store is not None else None,
        store_unread_chunk_hits=store.unread_chunk_hits if store is not None else None,
        store_refusals=dict(store.refusals) if store is not None else {},
    )


def _wire_gauges(ctx: ServiceContext) -> None:
    """Gauges read at scrape time: stored bytes from the registry, pool occupancy from its owner; the
    storage counters through `ctx.pool_stats` / `ctx.store_stats` (looked up at each scrape, since the
    store is attached after the context is built); the static build and capacity gauges."""
    m = ctx.metrics
    settings = ctx.settings

    def stored_bytes() -> float:
        with ctx.sessions() as s:
            return float(SegmentRepository(s).totals().bytes)

    m.stored_bytes.set_function(stored_bytes)
    m.store_capacity_bytes.set(settings.kv_capacity_bytes)
    m.read_storage_counts(lambda: _storage_counts(ctx))
    m.set_build_info(
        numerics=resolve_cpu_path(settings.model_numerics),
        device=settings.model_device,
        kernel_backend=settings.model_kernel_backend,
    )
    m.pool_budget_bytes.set(settings.pool_budget_bytes)
    m.running_turns.set_function(lambda: float(len(ctx.running)))
    if ctx.pool_stats is not None:
        pool = ctx.pool_stats
        m.pool_bytes.set_function(lambda: float(pool().bytes_used))
        m.pool_entries.set_function(lambda: float(pool().entries))
        m.pool_budget_bytes.set_function(lambda: float(pool().budget_bytes))
