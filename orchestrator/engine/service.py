"""Assembly of one serving node: registry (SQL), global KV store (RocksDB) mirroring its audit records
into the SQL log, window pool, served models, turn engine, and the start-up reconciliation.

Knows nothing of the gRPC server object (`orchestrator.api.build_server` takes the context this builds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog
import torch
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from model import ModelConfig, load_preset
from orchestrator.api import PoolStats, ServiceContext, build_context
from orchestrator.db import (
    AuditChecker,
    EffectivePolicy,
    OrphanSweeper,
    PolicyRepository,
    ReconcileReport,
    TenantRepository,
    mirror_and_forget,
    reconcile_with_prefixes,
    run_serializable,
)
from orchestrator.db.models import SessionRow, TurnRow, TurnStatus
from orchestrator.engine.model_catalog import RegistryCatalog
from orchestrator.engine.model_compute import ModelCompute, TorchCompute
from orchestrator.engine.served_models import ModelRegistry, ServedModelSpec
from orchestrator.engine.swap import ArtifactMappers, KVMapperApplier
from orchestrator.engine.turn_engine import TurnEngine
from orchestrator.jobs import FitJobService
from orchestrator.model_process import ProcessCompute
from orchestrator.planner import CostTable
from orchestrator.registry_writer import RegistryWriter
from orchestrator.scheduler import MetricsObserver, build_scheduler
from orchestrator.settings import Settings
from storage import (
    AnchorFile,
    AnchorKey,
    GlobalKVStore,
    PoolConfig,
    PurgeResult,
    RetentionPolicy,
    StoreConfig,
    WindowPool,
    open_store,
    refuse_newer_format,
)

__all__ = ["NodeService", "build_node", "PurgeFanout"]

log = structlog.get_logger(__name__)


class PurgeFanout:
    """The purger's view of this node's bytes: the store, plus the pool entries a purge makes stale
    (a purged session's or tenant's windows are derived bytes too)."""

    def __init__(self, pool: WindowPool) -> None:
        self._pool = pool
        self.store: GlobalKVStore | None = None

    def _store(self) -> GlobalKVStore:
        assert self.store is not None, "PurgeFanout used before the store was attached"
        return self.store

    def purge_session(self, tenant: str, session: str, *, actor: str, reason: str = "request") -> PurgeResult:
        self._pool.discard(tenant, session)
        return self._store().purge_session(tenant, session, actor=actor, reason=reason)

    def purge_tenant(self, tenant: str, *, actor: str, reason: str = "request") -> PurgeResult:
        self._pool.discard_tenant(tenant)
        return self._store().purge_tenant(tenant, actor=actor, reason=reason)

    def purge_model(
        self, model_fingerprint: str, *, tenant: str | None = None, actor: str, reason: str = "request"
    ) -> PurgeResult:
        # The pool indexes entries by content under their model's fingerprint (turn_engine's ContentKey).
        self._pool.discard_namespace(model_fingerprint, tenant=tenant)
        return self._store().purge_model(model_fingerprint, tenant=tenant, actor=actor, reason=reason)


def _spec_config(spec: ServedModelSpec) -> ModelConfig:
    if spec.checkpoint is not None:
        return ModelConfig.from_json(spec.checkpoint / "config.json")
    assert spec.config is not None
    return ModelConfig.from_json(spec.config) if spec.config.endswith(".json") else load_preset(spec.config)


def _ratios(registry: ModelRegistry) -> tuple[int, ...]:
    ratios: set[int] = set()
    for name in registry.names:
        spec = registry.spec(name)
        assert spec is not None
        cfg = _spec_config(spec)
        ratios |= {r for r in cfg.compress_ratios[: cfg.n_layers] if r > 0}
    return tuple(sorted(ratios)) or (1,)


def _model_labels(registry: ModelRegistry, name: str, *, loaded: bool) -> dict[str, str]:
    """Labels of a served model's info series; its fingerprint only when it was loaded at start (a model
    loaded on its first turn is not loaded here just to label a metric)."""
    spec = registry.spec(name)
    assert spec is not None
    served = registry.get(name) if loaded else None
    return {"source": spec.source, "fingerprint": served.fingerprint_hex if served is not None else ""}


def _store_policy(policy: EffectivePolicy) -> RetentionPolicy:
    """The store's form of a registry policy (an empty region list there means: anywhere)."""
    regions = tuple(policy.allowed_regions) if policy.allowed_regions else None
    return RetentionPolicy(floor_s=policy.floor_s, ceiling_s=policy.ceiling_s, allowed_regions=regions)


def _sync_policies(ctx: ServiceContext, store: GlobalKVStore) -> int:
    """Push every tenant's effective policy from SQL into the store where the store's copy differs.

    SQL is authoritative; the store only hears of changes made through this process, so a policy set
    while the node was down, or on another replica, reaches it here. Returns how many were pushed.
    """
    settings = ctx.settings
    policies: list[EffectivePolicy] = []
    with ctx.sessions() as s:
        repo = PolicyRepository(s)
        for tenant in TenantRepository(s).list_ids():
            try:
                policies.append(
                    repo.effective(
                        tenant,
                        default_floor_s=settings.retention_floor_s,
                        default_ceiling_s=settings.retention_ceiling_s,
                    )
                )
            except ValueError as exc:
                # No stored row may stop a node from starting (see below).
                log.error("policy_sync_refused", tenant=tenant[:128], error=str(exc)[:1024])
    pushed = 0
    for policy in policies:
        try:
            wanted = _store_policy(policy)
            # Equal copies are skipped so that a restart does not write one audit record per tenant.
            if store.get_policy(policy.tenant_id) != wanted:
                store.set_policy(policy.tenant_id, wanted, actor="node_start", reason="sync_from_registry")
                pushed += 1
        except ValueError as exc:
            # A row the store cannot hold (written by an older version that validated less, or a tenant
            # id longer than the store's) must not stop the node: the store keeps its current copy, and
            # the admin can set a valid policy.
            log.error("policy_sync_refused", tenant=policy.tenant_id[:128], error=str(exc)[:1024])
    return pushed


def _audit_checker(
    settings: Settings, ctx: ServiceContext, store: GlobalKVStore, clock: Callable[[], float]
) -> AuditChecker:
    """The node's audit check over the SQL log and the store's chain, anchored when a key file is set.

    Raises:
        ValueError: `audit_anchor_key_file` is set but cannot be read or holds too short a key.
    """
    key_file = settings.audit_anchor_key_file
    key = AnchorKey.from_file(key_file) if key_file is not None else None
    return AuditChecker(
        ctx.audit,
        store_audit=store.audit,
        store_acked_seq=lambda: store.audit_acked_seq,
        anchor_file=AnchorFile(settings.audit_anchor_file) if key is not None else None,
        key=key,
        node=ctx.node,
        interval_s=settings.audit_anchor_interval_s,
        clock=clock,
    )


def _drop_stale_turns(ctx: ServiceContext) -> int:
    """Delete RUNNING turn rows of this node's sessions: at start-up no turn runs here, so they are
    leftovers of a process that died mid-turn (they never became history)."""

    def work(s: Session) -> int:
        mine = select(SessionRow.id).where(SessionRow.node == ctx.node)
        result = s.execute(
            delete(TurnRow).where(TurnRow.status == TurnStatus.RUNNING, TurnRow.session_id.in_(mine))
        )
        return int(result.rowcount or 0)

    return run_serializable(ctx.serializable, work)


def _swap_state_builder(compute: ModelCompute) -> Callable[..., object] | None:
    """Where a model swap builds its receiver state: in the model process when there is one (its states
    live there), else here."""
    return compute.state_from_global if isinstance(compute, ProcessCompute) else None


@dataclass(kw_only=True)
class NodeService:
    """Everything one node runs; `close` releases the store and the registry engine."""

    ctx: ServiceContext
    store: GlobalKVStore
    pool: WindowPool
    registry: ModelRegistry
    engine: TurnEngine
    reconcile: ReconcileReport
    orphans: OrphanSweeper | None = None

    def close(self) -> None:
        if self.ctx.fit_jobs is not None:
            self.ctx.fit_jobs.close()
        self.engine.scheduler.close()
        close_compute = getattr(self.engine.compute, "close", None)
        if close_compute is not None:
            close_compute()  # the model process (model_process = "separate")
        if self.engine.registry_writer is not None:
            self.engine.registry_writer.close()
        if self.ctx.audit_checker is not None:
            # A last anchor while the store is still open: a clean stop leaves no unanchored tail.
            self.ctx.audit_checker.stop()
        if self.orphans is not None:
            self.orphans.stop()
        self.store.stop_maintenance()
        self.store.close()
        self.ctx.close()


def _registry_writer(settings: Settings, ctx: ServiceContext) -> RegistryWriter | None:
    """The registry writer process for a SQLite file registry with `registry_writer = "process"`, started
    by the turn engine at the node's first concurrent turns (None: PostgreSQL, an in-memory SQLite, or
    "inline")."""
    url = ctx.engine.url
    in_file = url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:")
    if settings.registry_writer != "process" or not in_file or "mode=memory" in str(url):
        return None
    return RegistryWriter(settings.resolved_database_url, child_start=settings.child_start)


def build_node(
    settings: Settings,
    *,
    registry: ModelRegistry | None = None,
    mappers: KVMapperApplier | None = None,
    clock: Callable[[], float] = time.time,
    pool_clock: Callable[[], float] = time.monotonic,
    maintenance: bool = False,
    migrate: bool = True,
    compute: ModelCompute | None = None,
    preload: bool = False,
    prefill_chunk_tokens: int = 1024,
    model_cpus: Collection[int] = (),
) -> NodeService:
    """Open the registry, the store (under `data_dir/kv`), the pool and the models; wire the engine.

    Args:
        registry: served models (default: from `settings.served_models`; with `model_process =
            "separate"` this process then keeps their fingerprints, not their weights).
        mappers: applies registered mapper artifacts on a model switch (default: `ArtifactMappers`).
        clock: wall clock of the store and registry stamps; pool_clock: the pool's TTL clock.
        maintenance: start the store's background expiry/deletion thread.
        compute: the model operations (default: the real model; benchmarks pass a no-op stand-in).
        preload: load every served model now (else on its first turn, inside that turn's latency).
        prefill_chunk_tokens: longest prompt slice run in one forward pass.
        model_cpus: the CPUs of the model process (`model_process = "separate"`, default compute), one
            torch thread each at most: an entry point's `cpu_split.enter_cpu_split`, which pinned this
            process to the others. Empty: no pinning.

    Raises:
        ValueError: a served-model source or a chunk size that does not fit the models' ratios.
        StoreVersionError: the store under `data_dir/kv` is of a newer format (raised before the
            registry or the store was opened; a damaged store is quarantined instead).
    """
    registry = (
        registry
        if registry is not None
        else ModelRegistry.from_sources(
            settings.served_models,
            device=settings.model_device,
            kernel_backend=settings.model_kernel_backend,
            cpu_path=settings.model_numerics,
            linear_math=settings.model_math,
            # the models compute in the model process: this one keeps their fingerprints, not their weights
            hold_weights=settings.model_process != "separate",
        )
    )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    ratios = _ratios(registry)
    if settings.kv_chunk_tokens % math.lcm(*ratios):
        raise ValueError(
            f"kv_chunk_tokens={settings.kv_chunk_tokens} is not a multiple of the ratios {ratios}"
        )
    pool = WindowPool(
        PoolConfig(budget_bytes=settings.pool_budget_bytes, ttl_s=settings.pool_ttl_s), clock=pool_clock
    )

    def pool_stats() -> PoolStats:
        p = pool.stats()
        return PoolStats(
            bytes_used=p.bytes_used,
            budget_bytes=p.budget_bytes,
            entries=p.entries,
            expired=p.expired,
            evicted_lru=p.evicted_lru,
            refused=p.refused,
        )

    fanout = PurgeFanout(pool)
    store_cfg = StoreConfig(
        path=str(settings.data_dir / "kv"),
        region=settings.region,
        chunk_tokens=settings.kv_chunk_tokens,
        compression_ratios=ratios,
        capacity_bytes=settings.kv_capacity_bytes,
    )
    refuse_newer_format(store_cfg)
    ctx = build_context(settings, migrate=migrate, store=fanout, pool_stats=pool_stats)
    # The SQL audit log is authoritative while the service runs: every store record is mirrored there.
    # Mirrored with them: the rows of chunks the store's records say are gone (expired, evicted, ...).
    on_audit = mirror_and_forget(ctx.serializable, ctx.audit, node=ctx.node)
    # A damaged database is quarantined and the node starts with an empty store (the rows of its chunks
    # are reconciled away below); only a newer format refuses, checked before anything was opened.
    store = open_store(store_cfg, clock=clock, on_audit=on_audit)
    ctx.store_health = store.health
    ctx.store_probe = store.probe_write
    fanout.store = store
    ctx.store_stats = store.stats
    ctx.audit_checker = _audit_checker(settings, ctx, store, clock)

    def on_policy_change(policy: EffectivePolicy, actor: str) -> None:
        store.set_policy(policy.tenant_id, _store_policy(policy), actor=actor)
        if not policy.may_store_in(settings.region):
            pool.discard_tenant(policy.tenant_id)

    def check_policy(policy: EffectivePolicy) -> None:
        # The store's own validation (RetentionPolicy); tenant ids were bounded at the edge.
        _store_policy(policy)

    ctx.check_policy = check_policy
    ctx.on_policy_change = on_policy_change
    costs = (
        CostTable.load(settings.calibration_file) if settings.calibration_file is not None else CostTable()
    )
    if compute is None:
        threads = torch.get_num_threads()
        compute = (
            # one thread per CPU of its own at most: more would take turns on the same cores
            ProcessCompute.from_registry(
                registry, threads=min(threads, len(model_cpus)) if model_cpus else threads, cpus=model_cpus,
                tune_gc=settings.tune_gc, child_start=settings.child_start,
            )
            if settings.model_process == "separate"
            else TorchCompute()
        )
    scheduler = build_scheduler(
        settings.scheduler,
        compute,
        max_batch_sequences=settings.max_batch_sequences,
        step_token_budget=settings.step_token_budget,
        max_running_turns=settings.max_running_turns,
        observer=MetricsObserver(ctx.metrics),
    )
    engine = TurnEngine(
        registry_writer=_registry_writer(settings, ctx),
        ctx=ctx,
        registry=registry,
        store=store,
        pool=pool,
        costs=costs,
        mappers=mappers if mappers is not None else ArtifactMappers(build_state=_swap_state_builder(compute)),
        clock=clock,
        compute=compute,
        prefill_chunk_tokens=prefill_chunk_tokens,
        scheduler=scheduler,
    )
    ctx.turn_handler = engine
    ctx.served_models = registry.names
    ctx.model_catalog = RegistryCatalog(registry)
    ctx.fit_jobs = FitJobService(
        settings=settings,
        sessions=ctx.sessions,
        serializable=ctx.serializable,
        node=ctx.node,
        model_sources={n: registry.spec(n).source for n in registry.names},  # type: ignore[union-attr]
    )
    # Before anything is admitted: this node's unfinished jobs lost their children when it went down.
    fit_jobs_failed = ctx.fit_jobs.recover()
    stale = _drop_stale_turns(ctx)
    # Before reconciling: a synced policy may purge (residency) or expire chunks the rows still name.
    policies_synced = _sync_policies(ctx, store)
    report = reconcile_with_prefixes(
        ctx.serializable, node=ctx.node, stored_prefix=lambda t, fp, toks: store.lookup(t, fp, toks).n_tokens
    )
    orphans = OrphanSweeper(
        ctx.serializable,
        store,
        node=ctx.node,
        grace_s=settings.orphan_grace_s,
        interval_s=min(max(settings.orphan_grace_s, 1.0), 600.0),
        clock=clock,
    )
    orphans.sweep()
    if preload:
        for name in registry.names:
            served = registry.get(name)
            if isinstance(compute, ProcessCompute):
                compute.preload(served)  # the model process starts now, not inside a first turn
    ctx.metrics.set_served_models({n: _model_labels(registry, n, loaded=preload) for n in registry.names})
    if maintenance:
        store.start_maintenance()
        orphans.start()
    # After the store re-mirrored its unacknowledged records and the policy sync: the first anchor
    # covers the chains as this start leaves them.
    ctx.audit_checker.start()
    log.info(
        "node_ready",
        models={n: registry.spec(n).source for n in registry.names},  # type: ignore[union-attr]
        region=settings.region,
        chunk_tokens=settings.kv_chunk_tokens,
        dangling_rows_deleted=report.dangling_rows_deleted,
        orphan_chunks_deleted=orphans.deleted[0],
        stale_running_turns_deleted=stale,
        policies_synced=policies_synced,
        fit_jobs_failed_on_restart=fit_jobs_failed,
        store_quarantined=store.quarantined_at_open.name if store.quarantined_at_open is not None else None,
    )
    return NodeService(
        ctx=ctx, store=store, pool=pool, registry=registry, engine=engine, reconcile=report, orphans=orphans
    )
