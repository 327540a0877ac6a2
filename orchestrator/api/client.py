"""Client side of the API for the CLI and tests: channel, bearer metadata, message printing.

Knows nothing of the servicers; talks to any kvresume.v1 server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

__all__ = ["open_channel", "bearer_metadata", "message_json", "rpc_error_text"]


def open_channel(target: str, *, tls_ca_file: Path | None = None) -> grpc.Channel:
    """A channel to `target` (host:port), TLS when a CA bundle is given."""
    if tls_ca_file is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())
        return grpc.secure_channel(target, creds)
    return grpc.insecure_channel(target)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    if not token:
        raise ValueError("no token given (flag --token, or KVRESUME_TOKEN / KVRESUME_ADMIN_TOKEN)")
    return (("authorization", f"Bearer {token}"),)


def message_json(message: Any) -> str:
    """One message as compact JSON with proto field names (zero values included)."""
    return json.dumps(
        MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
        sort_keys=True,
    )


def rpc_error_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'UNKNOWN'}: {details}"
