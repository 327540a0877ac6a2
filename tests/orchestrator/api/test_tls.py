"""With a certificate and key in the settings the server speaks TLS only; clients trust it via the CA."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvresume import open_channel
from orchestrator.api import build_context, build_server
from tests.orchestrator.api.conftest import bearer, make_settings

TLS = Path(__file__).parent / "tls"


def test_server_serves_tls_when_configured(tmp_path) -> None:
    settings = make_settings(tmp_path, tls_cert_file=TLS / "server.crt", tls_key_file=TLS / "server.key")
    ctx = build_context(settings)
    running = build_server(ctx, host="127.0.0.1", port=0)
    try:
        req = ctx.stubs.sessions.CreateSessionRequest(model="small")
        with open_channel(f"127.0.0.1:{running.port}", tls_ca_file=TLS / "server.crt") as channel:
            reply = ctx.stubs.sessions_grpc.SessionsStub(channel).CreateSession(
                req, metadata=bearer("tok-acme")
            )
            assert reply.session.tenant_id == "acme"
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as plain:
            with pytest.raises(grpc.RpcError) as info:
                ctx.stubs.sessions_grpc.SessionsStub(plain).CreateSession(
                    req, metadata=bearer("tok-acme"), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(grace_s=None)
        ctx.close()
