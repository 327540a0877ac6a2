"""The resume planner: pure functions from a turn's facts to a plan, and the cost model it prices with.

Knows nothing of SQL, storage, gRPC or the model (W and the group alignment come in as plain ints).
"""

from orchestrator.planner.calibration import measure_costs
from orchestrator.planner.costs import BUILTIN_COSTS, Costs, CostTable, estimate_seconds
from orchestrator.planner.inputs import (
    CacheInventory,
    MapperInfo,
    ModelGeometry,
    PooledPrefix,
    PoolState,
    SessionView,
)
from orchestrator.planner.plan import Plan, PlanReason, ResumePath, TokenCounts
from orchestrator.planner.planner import no_mapper_reason, plan_turn

__all__ = [
    "BUILTIN_COSTS",
    "CacheInventory",
    "CostTable",
    "Costs",
    "MapperInfo",
    "ModelGeometry",
    "Plan",
    "PlanReason",
    "PoolState",
    "PooledPrefix",
    "ResumePath",
    "SessionView",
    "TokenCounts",
    "estimate_seconds",
    "measure_costs",
    "no_mapper_reason",
    "plan_turn",
]
