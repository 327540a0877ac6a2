"""The gRPC API surface: stubs, auth, the error-to-status table, servicers, and server assembly.

Protobuf types stop at the servicers; everything below sees domain dataclasses.
"""

from orchestrator.api.auth import Authenticator, Caller
from orchestrator.api.context import PoolStats, ServiceContext, build_context
from orchestrator.api.errors import (
    CancelledError,
    DeadlineError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    check_name_length,
    model_not_served,
)
from orchestrator.api.metrics import ServiceMetrics
from orchestrator.api.model_catalog import ModelCatalog, ModelDescription
from orchestrator.api.running_turns import RunningTurns, TurnHandle
from orchestrator.api.server import RunningServer, build_server
from orchestrator.api.status_table import STATUS_TABLE, status_for
from orchestrator.api.stubs import Stubs, load_stubs
from orchestrator.api.turn_log import configure_logging, log_turn_decision
from orchestrator.api.turn_types import (
    FinishReason,
    GenerationSpec,
    PlanEvent,
    TokenChunkEvent,
    TurnEvent,
    TurnHandler,
    TurnInput,
    TurnStatsEvent,
)

__all__ = [
    "STATUS_TABLE",
    "Authenticator",
    "Caller",
    "CancelledError",
    "DeadlineError",
    "FinishReason",
    "GenerationSpec",
    "InvalidRequestError",
    "ModelCatalog",
    "ModelDescription",
    "NotFoundError",
    "PermissionDeniedError",
    "PlanEvent",
    "PoolStats",
    "PreconditionError",
    "ResourceExhaustedError",
    "RunningServer",
    "RunningTurns",
    "ServiceContext",
    "ServiceMetrics",
    "Stubs",
    "TokenChunkEvent",
    "TurnEvent",
    "TurnHandle",
    "TurnHandler",
    "TurnInput",
    "TurnStatsEvent",
    "UnauthenticatedError",
    "UnavailableError",
    "build_context",
    "build_server",
    "configure_logging",
    "load_stubs",
    "check_name_length",
    "model_not_served",
    "log_turn_decision",
    "status_for",
]
