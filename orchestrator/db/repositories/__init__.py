"""Repositories over the registry tables; each receives the caller's Session and never commits."""

from orchestrator.db.repositories.driver_dml import DriverDML
from orchestrator.db.repositories.fit_jobs import UNFINISHED_PHASES, FitJobRepository, FitJobSubmission
from orchestrator.db.repositories.mappers import MapperRegistration, MapperRepository
from orchestrator.db.repositories.policies import EffectivePolicy, PolicyRepository
from orchestrator.db.repositories.retained_keys import RetainedKeys
from orchestrator.db.repositories.segments import DurableSegment, SegmentRepository, SegmentTotals
from orchestrator.db.repositories.session_create import SessionCreate
from orchestrator.db.repositories.sessions import SessionRepository
from orchestrator.db.repositories.tenants import TenantRepository
from orchestrator.db.repositories.turn_reads import TurnReads, TurnSnapshot
from orchestrator.db.repositories.turns import TurnCounts, TurnRepository, TurnTimings

__all__ = [
    "DriverDML",
    "DurableSegment",
    "EffectivePolicy",
    "FitJobRepository",
    "FitJobSubmission",
    "MapperRegistration",
    "MapperRepository",
    "PolicyRepository",
    "RetainedKeys",
    "SegmentRepository",
    "SegmentTotals",
    "SessionCreate",
    "SessionRepository",
    "TenantRepository",
    "TurnCounts",
    "TurnReads",
    "TurnRepository",
    "TurnSnapshot",
    "TurnTimings",
    "UNFINISHED_PHASES",
]
