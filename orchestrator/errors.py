"""Errors raised by orchestrator/."""

from __future__ import annotations

__all__ = ["OrchestratorError"]


class OrchestratorError(Exception):
    """Base class of orchestrator errors; the servicer maps each subclass to one gRPC status code.

    Args:
        message: for people (the status message).
        reason: a stable code, a name of the proto's ErrorReason without its prefix (ErrorInfo.reason);
            None: the class's `default_reason`.
        field: the request field at fault, when one is (ErrorInfo.metadata["field"]).
        retry_after_s: when a retry may succeed (RetryInfo); None: the class's `default_retry_after_s`.
    """

    default_reason = "INTERNAL"
    default_retry_after_s: float | None = None

    def __init__(
        self,
        message: str = "",
        *,
        reason: str | None = None,
        field: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason or self.default_reason
        self.field = field
        self.retry_after_s = retry_after_s if retry_after_s is not None else self.default_retry_after_s
