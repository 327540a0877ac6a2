"""A client of any kvresume.v1 server: a channel with bearer metadata, the four service stubs, and the
machine-readable error details (google.rpc ErrorInfo / RetryInfo) of a failed call.

Needs grpcio, protobuf, grpcio-status and googleapis-common-protos; nothing of the model stack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvresume.v1 import (
    admin_pb2_grpc,
    mappers_pb2_grpc,
    models_pb2_grpc,
    sessions_pb2_grpc,
)

__all__ = [
    "Client",
    "ErrorDetails",
    "ERROR_DOMAIN",
    "bearer_metadata",
    "error_details",
    "message_json",
    "open_channel",
    "rpc_error_text",
]

# ErrorInfo.domain of every error this service raises.
ERROR_DOMAIN = "kvresume.v1"


def open_channel(target: str, *, tls_ca_file: Path | None = None) -> grpc.Channel:
    """A channel to `target` (host:port), TLS when a CA bundle is given."""
    if tls_ca_file is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())
        return grpc.secure_channel(target, creds)
    return grpc.insecure_channel(target)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The `authorization` metadata of every call.

    Raises:
        ValueError: no token.
    """
    if not token:
        raise ValueError("no token given (flag --token, or KVRESUME_TOKEN / KVRESUME_ADMIN_TOKEN)")
    return (("authorization", f"Bearer {token}"),)


def message_json(message: Any) -> str:
    """One message as compact JSON with proto field names (zero values included)."""
    return json.dumps(
        MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
        sort_keys=True,
    )


@dataclass(frozen=True, kw_only=True)
class ErrorDetails:
    """What a failed call says, for programs.

    Attributes:
        code: the gRPC status code's name ("NOT_FOUND").
        message: the status message (for people; may change between versions).
        reason: ErrorInfo.reason, a name of the proto's ErrorReason without its prefix
            ("SESSION_NOT_FOUND"); empty when the server sent no ErrorInfo.
        metadata: ErrorInfo.metadata (for example {"field": "max_new_tokens"}).
        retry_after_s: RetryInfo.retry_delay in seconds, None when the server sent none.
    """

    code: str
    message: str
    reason: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "reason": self.reason,
            "metadata": dict(self.metadata),
            "retry_after_s": self.retry_after_s,
        }


def error_details(exc: grpc.RpcError) -> ErrorDetails:
    """The status code, message, ErrorInfo and RetryInfo of a failed call."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    code = exc.code().name if hasattr(exc, "code") and exc.code() is not None else "UNKNOWN"
    message = exc.details() if hasattr(exc, "details") else str(exc)
    reason, metadata, retry = "", {}, None
    try:
        status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    except ValueError:
        # The trailer disagreed with the call's own code or message: keep what the call said.
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            delay = error_details_pb2.RetryInfo()
            detail.Unpack(delay)
            retry = delay.retry_delay.seconds + delay.retry_delay.nanos / 1e9
    return ErrorDetails(
        code=code, message=message or "", reason=reason, metadata=metadata, retry_after_s=retry
    )


def rpc_error_text(exc: grpc.RpcError) -> str:
    """One line for people: `CODE [REASON]: message`."""
    d = error_details(exc)
    reason = f" [{d.reason}]" if d.reason else ""
    retry = f" (retry after {d.retry_after_s:g} s)" if d.retry_after_s is not None else ""
    return f"{d.code}{reason}: {d.message}{retry}"


class Client:
    """Stubs of the Sessions, Models, Admin and Mappers services on one channel, with the token's
    metadata bound: `client.call("sessions", "GetSession", request)`, or the stubs themselves with
    `metadata=client.metadata`.

    Args:
        target: host:port of the server.
        token: a tenant token (Sessions, Models) or the admin token (Admin, mapper registration).
        tls_ca_file: a CA bundle; TLS when given.
        timeout_s: default deadline of each call (None: none).
    """

    def __init__(
        self, target: str, *, token: str, tls_ca_file: Path | None = None, timeout_s: float | None = None
    ) -> None:
        self.metadata = bearer_metadata(token)
        self.timeout_s = timeout_s
        self.channel = open_channel(target, tls_ca_file=tls_ca_file)
        self.sessions = sessions_pb2_grpc.SessionsStub(self.channel)
        self.models = models_pb2_grpc.ModelsStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.mappers = mappers_pb2_grpc.MappersStub(self.channel)

    def call(self, service: str, method: str, request: Any, *, timeout_s: float | None = None) -> Any:
        """A unary call, or the iterator of a streaming one, with the bearer metadata and deadline.

        Raises:
            ValueError: an unknown service or method name.
        """
        stub = getattr(self, service, None)
        if service not in ("sessions", "models", "admin", "mappers") or not hasattr(stub, method):
            raise ValueError(f"unknown RPC {service}.{method}")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        return getattr(stub, method)(request, metadata=self.metadata, timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
