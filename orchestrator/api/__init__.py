"""The gRPC API surface: stubs, auth, the error-to-status table, servicers, and server assembly.

Protobuf types stop at the servicers; everything below sees domain dataclasses.

Its names are imported from their modules on first use (PEP 562), as in `orchestrator.engine`: a
process that needs one module of the package (the model process: the errors its calls raise, the
scheduler's and sampler's types) does not import the rest (the registry's SQLAlchemy and Alembic, grpc,
the store), which was about 0.9 s of every model process's start on the 2-vCPU VMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy_exports import lazy_exports

if TYPE_CHECKING:
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

# name -> the module that defines it
_HOMES: dict[str, str] = {
    "Authenticator": "orchestrator.api.auth",
    "Caller": "orchestrator.api.auth",
    "PoolStats": "orchestrator.api.context",
    "ServiceContext": "orchestrator.api.context",
    "build_context": "orchestrator.api.context",
    "CancelledError": "orchestrator.api.errors",
    "DeadlineError": "orchestrator.api.errors",
    "InvalidRequestError": "orchestrator.api.errors",
    "NotFoundError": "orchestrator.api.errors",
    "PermissionDeniedError": "orchestrator.api.errors",
    "PreconditionError": "orchestrator.api.errors",
    "ResourceExhaustedError": "orchestrator.api.errors",
    "UnauthenticatedError": "orchestrator.api.errors",
    "UnavailableError": "orchestrator.api.errors",
    "check_name_length": "orchestrator.api.errors",
    "model_not_served": "orchestrator.api.errors",
    "ServiceMetrics": "orchestrator.api.metrics",
    "ModelCatalog": "orchestrator.api.model_catalog",
    "ModelDescription": "orchestrator.api.model_catalog",
    "RunningTurns": "orchestrator.api.running_turns",
    "TurnHandle": "orchestrator.api.running_turns",
    "RunningServer": "orchestrator.api.server",
    "build_server": "orchestrator.api.server",
    "STATUS_TABLE": "orchestrator.api.status_table",
    "status_for": "orchestrator.api.status_table",
    "Stubs": "orchestrator.api.stubs",
    "load_stubs": "orchestrator.api.stubs",
    "configure_logging": "orchestrator.api.turn_log",
    "log_turn_decision": "orchestrator.api.turn_log",
    "FinishReason": "orchestrator.api.turn_types",
    "GenerationSpec": "orchestrator.api.turn_types",
    "PlanEvent": "orchestrator.api.turn_types",
    "TokenChunkEvent": "orchestrator.api.turn_types",
    "TurnEvent": "orchestrator.api.turn_types",
    "TurnHandler": "orchestrator.api.turn_types",
    "TurnInput": "orchestrator.api.turn_types",
    "TurnStatsEvent": "orchestrator.api.turn_types",
}

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


__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
