"""An in-process server on port 0 over a tmp SQLite registry migrated to head, with a gRPC channel."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.api import RunningServer, ServiceContext, Stubs, build_context, build_server
from orchestrator.settings import Settings

TENANT_TOKENS = {"acme": "tok-acme", "globex": "tok-globex", "initech": "tok-initech"}
ADMIN_TOKEN = "tok-admin"


@dataclass
class Service:
    ctx: ServiceContext
    server: RunningServer
    channel: grpc.Channel
    pb: Stubs

    def sessions(self) -> Any:
        return self.pb.sessions_grpc.SessionsStub(self.channel)

    def admin(self) -> Any:
        return self.pb.admin_grpc.AdminStub(self.channel)

    def mappers(self) -> Any:
        return self.pb.mappers_grpc.MappersStub(self.channel)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def make_settings(tmp: Path, **overrides: Any) -> Settings:
    overrides.setdefault("database_url", f"sqlite:///{tmp / 'registry.sqlite3'}")
    return Settings(
        data_dir=tmp,
        tenant_tokens=TENANT_TOKENS,
        admin_token=ADMIN_TOKEN,
        grpc_host="127.0.0.1",
        grpc_port=0,
        region="eu-1",
        max_turn_tokens=64,
        max_new_tokens=32,
        max_request_bytes=64 * 1024,
        max_sessions_per_tenant=5,
        pool_budget_bytes=1 << 20,
        **overrides,
    )


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("svc")
    ctx = build_context(make_settings(tmp))
    running = build_server(ctx, host="127.0.0.1", port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield Service(ctx=ctx, server=running, channel=channel, pb=ctx.stubs)
    finally:
        channel.close()
        running.stop(grace_s=None)
        ctx.close()
