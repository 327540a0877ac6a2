"""A real node for the HTTP front door's tests: the shipped trained v41-sib-s checkpoint, a tmp SQLite
registry migrated to head, RocksDB store and window pool under tmp_path, gRPC and HTTP servers on loopback
port 0 in this process (the HTTP server on its own uvicorn thread, as `kvresume serve --http-port` runs it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from orchestrator.api import RunningServer, build_server
from orchestrator.engine import ModelRegistry, NodeService, ServedModelSpec, build_node
from orchestrator.http import RunningHttpServer, start_http_server
from orchestrator.settings import Settings

REPO = Path(__file__).resolve().parents[3]
MODEL = "v41-sib-s"
TOKENS = {"acme": "tok-acme", "globex": "tok-globex"}
ADMIN = "tok-admin"


@dataclass
class HttpNode:
    service: NodeService
    grpc_server: RunningServer
    http: RunningHttpServer
    channel: grpc.Channel

    @property
    def base_url(self) -> str:
        return self.http.base_url

    @property
    def pb(self) -> Any:
        return self.service.ctx.stubs

    def client(self, tenant: str = "acme", **kwargs: Any) -> openai.OpenAI:
        """The official client; no retries, so that each error a test provokes is answered once."""
        return openai.OpenAI(
            base_url=self.base_url, api_key=TOKENS[tenant], max_retries=0, timeout=120, **kwargs
        )

    def md(self, tenant: str = "acme") -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKENS[tenant]}"),)

    def history(self, session_id: str) -> list[int]:
        from orchestrator.db import SessionRepository

        with self.service.ctx.sessions() as s:
            return SessionRepository(s).history(session_id)

    def stop(self) -> None:
        self.http.stop(grace_s=1.0)
        self.channel.close()
        self.grpc_server.stop(grace_s=None)
        self.service.close()


def start_http_node(data_dir: Path, *, models: tuple[str, ...] = (MODEL,), **settings: Any) -> HttpNode:
    registry = ModelRegistry(
        {name: ServedModelSpec(name=name, checkpoint=REPO / "checkpoints" / name) for name in models}
    )
    values: dict[str, Any] = dict(
        data_dir=data_dir,
        database_url=f"sqlite:///{data_dir / 'registry.sqlite3'}",
        tenant_tokens=TOKENS,
        admin_token=ADMIN,
        grpc_port=0,
        metrics_enabled=False,
        region="eu-1",
        kv_chunk_tokens=32,
        pool_budget_bytes=64 << 20,
        max_new_tokens=64,
        grpc_workers=16,
    )
    values.update(settings)
    service = build_node(Settings(**values), registry=registry, preload=True)
    grpc_server = build_server(service.ctx, host="127.0.0.1", port=0)
    http = start_http_server(service.ctx, host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_server.port}")
    return HttpNode(service=service, grpc_server=grpc_server, http=http, channel=channel)


@pytest.fixture(scope="module")
def http_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpNode]:
    node = start_http_node(tmp_path_factory.mktemp("http"))
    try:
        yield node
    finally:
        node.stop()
