"""The OpenAI-compatible HTTP front door (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) over the
same engine, registry, auth and metrics as the gRPC API, served by uvicorn beside the gRPC server.

Knows nothing of protobuf; turns go through `orchestrator.api.turn_runner`, as gRPC turns do.
"""

from orchestrator.http.front_door import FrontDoor, PreparedTurn
from orchestrator.http.routes import build_app
from orchestrator.http.schemas import IGNORED_PARAMETERS, ChatCompletionRequest, CompletionRequest
from orchestrator.http.server import RunningHttpServer, start_http_server
from orchestrator.http.session_map import ForgettingPurger, SessionKeys

__all__ = [
    "IGNORED_PARAMETERS",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ForgettingPurger",
    "FrontDoor",
    "PreparedTurn",
    "RunningHttpServer",
    "SessionKeys",
    "build_app",
    "start_http_server",
]
