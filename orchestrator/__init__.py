"""Wires model, storage and mappers into the gRPC service, the planner, the SQL registry and the CLI.

Nothing imports orchestrator/ (migrations/ reads only its SQL metadata and settings).
"""

from orchestrator.errors import OrchestratorError

__all__ = ["OrchestratorError"]
