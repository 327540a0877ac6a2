"""Errors raised by orchestrator/."""


class OrchestratorError(Exception):
    """Base class of orchestrator errors; the servicer maps each subclass to one gRPC status code."""
