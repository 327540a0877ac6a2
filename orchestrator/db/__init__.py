"""The SQL session registry: typed models, repositories, migrations runner, audit sink, purge, reconcile.

Knows nothing of gRPC; the RPC handler owns each Session (one unit of work per call or turn).
"""

from orchestrator.db.audit_check import STORE_CHAIN_PREFIX, AuditChecker, AuditReport
from orchestrator.db.audit_sink import NODE_CHAIN, ChainVerdict, SqlAuditSink, heads_digest
from orchestrator.db.engine import make_engine, make_session_factory, scratch_schema
from orchestrator.db.migrate import downgrade, upgrade
from orchestrator.db.planner_views import mapper_infos, session_view
from orchestrator.db.purge import PurgeOutcome, Purger, StorePurger
from orchestrator.db.reconcile import (
    ORPHAN_REASON,
    RETENTION_REASON,
    OrphanSweeper,
    ReconcileReport,
    collect_orphans,
    forget_gone_chunks,
    mirror_and_forget,
    reconcile_segments,
    reconcile_with_prefixes,
)
from orchestrator.db.repositories import (
    DriverDML,
    DurableSegment,
    EffectivePolicy,
    MapperRegistration,
    MapperRepository,
    PolicyRepository,
    RetainedKeys,
    SegmentRepository,
    SegmentTotals,
    SessionCreate,
    SessionRepository,
    TenantRepository,
    TurnCounts,
    TurnReads,
    TurnRepository,
    TurnSnapshot,
    TurnTimings,
)
from orchestrator.db.transactions import (
    connection_of,
    run_serializable,
    run_serializable_connection,
    serializable_engine,
    serializable_factory,
)

__all__ = [
    "DriverDML",
    "NODE_CHAIN",
    "ORPHAN_REASON",
    "OrphanSweeper",
    "RETENTION_REASON",
    "STORE_CHAIN_PREFIX",
    "AuditChecker",
    "AuditReport",
    "ChainVerdict",
    "DurableSegment",
    "EffectivePolicy",
    "MapperRegistration",
    "MapperRepository",
    "PolicyRepository",
    "PurgeOutcome",
    "Purger",
    "ReconcileReport",
    "RetainedKeys",
    "SegmentRepository",
    "SegmentTotals",
    "SessionCreate",
    "SessionRepository",
    "SqlAuditSink",
    "StorePurger",
    "TenantRepository",
    "TurnCounts",
    "TurnReads",
    "TurnRepository",
    "TurnSnapshot",
    "TurnTimings",
    "downgrade",
    "collect_orphans",
    "connection_of",
    "forget_gone_chunks",
    "heads_digest",
    "make_engine",
    "make_session_factory",
    "scratch_schema",
    "mapper_infos",
    "mirror_and_forget",
    "reconcile_segments",
    "reconcile_with_prefixes",
    "run_serializable",
    "run_serializable_connection",
    "serializable_engine",
    "serializable_factory",
    "session_view",
    "upgrade",
]
