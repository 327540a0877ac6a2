"""The kvresume client: the API's generated modules and a small client, with grpcio and protobuf only.

Installs without the model stack (`pip install kvresume` gives this package and the `kvresume` client
commands; `pip install 'kvresume[server]'` adds what `kvresume serve` needs). Nothing here imports torch.
"""

from kvresume.client import (
    Client,
    ErrorDetails,
    bearer_metadata,
    error_details,
    message_json,
    open_channel,
    rpc_error_text,
)

__all__ = [
    "Client",
    "ErrorDetails",
    "bearer_metadata",
    "error_details",
    "message_json",
    "open_channel",
    "rpc_error_text",
]
