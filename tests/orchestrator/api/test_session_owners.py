"""SessionOwners: the LRU of owners the registry named, and the turn's ownership check over real gRPC
with it in place (another tenant, a closed and a deleted session are refused as without it)."""

from __future__ import annotations

import grpc
import pytest

from orchestrator.api.session_owners import SessionOwners
from tests.orchestrator.api.conftest import bearer


def test_session_owners_remembers_owners_up_to_its_capacity() -> None:
    owners = SessionOwners(capacity=2)
    owners.remember("s1", "acme")
    owners.remember("s2", "globex")
    assert owners.owned_by("s1", "acme") and not owners.owned_by("s1", "globex")
    # s1 was used last: s2 is the least recently used and goes first
    owners.remember("s3", "acme")
    assert len(owners) == 2 and not owners.owned_by("s2", "globex") and owners.owned_by("s3", "acme")
    owners.forget("s3")
    assert not owners.owned_by("s3", "acme") and not owners.owned_by("unknown", "acme")
    with pytest.raises(ValueError, match="capacity=0"):
        SessionOwners(capacity=0)


def _turn_code(service, sid: str, token: str) -> grpc.StatusCode:
    pb = service.pb
    request = pb.sessions.TurnRequest(session_id=sid, tokens=pb.sessions.TokenIds(ids=[5, 6]))
    try:
        list(service.sessions().Turn(request, metadata=bearer(token)))
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_turn_ownership_check_with_remembered_owners(service) -> None:
    pb, stub = service.pb, service.sessions()
    create = pb.sessions.CreateSessionRequest(model="m")
    closed = stub.CreateSession(create, metadata=bearer("tok-acme")).session.session_id
    deleted = stub.CreateSession(create, metadata=bearer("tok-acme")).session.session_id
    # Created here, so remembered: the check passes without a read (this server has no engine).
    assert service.ctx.owners.owned_by(closed, "acme")
    assert _turn_code(service, closed, "tok-acme") == grpc.StatusCode.UNIMPLEMENTED
    # Another tenant is not the remembered owner: it reads the registry and finds nothing of its own.
    assert _turn_code(service, closed, "tok-globex") == grpc.StatusCode.NOT_FOUND
    stub.CloseSession(pb.sessions.CloseSessionRequest(session_id=closed), metadata=bearer("tok-acme"))
    assert _turn_code(service, closed, "tok-acme") == grpc.StatusCode.FAILED_PRECONDITION
    stub.DeleteSession(pb.sessions.DeleteSessionRequest(session_id=deleted), metadata=bearer("tok-acme"))
    assert _turn_code(service, deleted, "tok-acme") == grpc.StatusCode.NOT_FOUND
