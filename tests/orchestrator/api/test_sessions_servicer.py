"""Sessions over real gRPC on loopback: tenancy, retention hints, limits, Turn streaming, Abort, Fork, Delete.

The Turn tests plug in `EchoTurnEngine`, a stand-in for the turn engine (not built yet) that plans with
the real planner and records turns through the real repositories; it exists to test the servicer's
streaming, validation, cancellation, metrics and canonical log line, not the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from kvresume import error_details
from orchestrator.api import (
    CancelledError,
    FinishReason,
    PlanEvent,
    TokenChunkEvent,
    TurnHandle,
    TurnInput,
    TurnStatsEvent,
)
from orchestrator.db import DurableSegment, SegmentRepository, SessionRepository, TurnRepository, TurnTimings
from orchestrator.planner import (
    BUILTIN_COSTS,
    CacheInventory,
    ModelGeometry,
    PoolState,
    SessionView,
    plan_turn,
)
from tests.orchestrator.api.conftest import ADMIN_TOKEN, bearer


class EchoTurnEngine:
    """Plans with the real planner (nothing stored, so cold), echoes the input reversed, records the turn."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self.block = threading.Event()

    def run_turn(self, turn: TurnInput, handle: TurnHandle) -> Iterator:
        self.last_turn = turn
        tokens = list(turn.tokens or turn.text.encode())
        with self._ctx.sessions() as s, s.begin():
            row = SessionRepository(s).get(turn.session_id, tenant_id=turn.tenant_id)
            view = SessionView(
                session_id=row.id,
                tenant_id=row.tenant_id,
                history_len=row.history_tokens,
                new_tokens=len(tokens),
                last_model=row.model if row.turn_count else None,
            )
            model = turn.model or row.model
            plan = plan_turn(
                view,
                model=model,
                geometry=ModelGeometry(window=8, group=4),
                cache=CacheInventory.empty(model, "store not wired in this test"),
                pool=PoolState.absent(),
                costs=BUILTIN_COSTS,
            )
            index = row.turn_count
        yield PlanEvent(plan=plan, turn_index=index)
        if self.block.is_set():
            handle.wait()
            raise CancelledError(handle.reason)
        out = tokens[::-1][: turn.generation.max_new_tokens]
        for i in range(0, len(out), 2):
            yield TokenChunkEvent(ids=tuple(out[i : i + 2]))
        with self._ctx.sessions() as s, s.begin():
            row = SessionRepository(s).get(turn.session_id, tenant_id=turn.tenant_id)
            repo = TurnRepository(s)
            t = repo.begin(row, model=model, input_tokens=tokens)
            repo.finish(t, row, output_tokens=out, timings=TurnTimings(ttft_s=0.01, total_s=0.02))
        yield TurnStatsEvent(
            turn_index=index,
            ttft_s=0.01,
            decode_tokens_per_s=100.0,
            counts=plan.counts,
            generated_tokens=len(out),
            finish_reason=FinishReason.LENGTH,
            total_s=0.02,
            persisted=False,
        )


@pytest.fixture
def engine(service):
    eng = EchoTurnEngine(service.ctx)
    service.ctx.turn_handler = eng
    yield eng
    service.ctx.turn_handler = None


def _code(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, **kwargs)
        if hasattr(result, "__iter__") and not hasattr(result, "session_id"):
            list(result)
    return info.value.code()


def _create(service, tenant_token: str, model: str = "small", **retention):
    pb = service.pb
    req = pb.sessions.CreateSessionRequest(model=model, retention=pb.common.RetentionHints(**retention))
    return service.sessions().CreateSession(req, metadata=bearer(tenant_token))


def test_create_session_tenant_sees_only_its_sessions(service) -> None:
    pb, stub = service.pb, service.sessions()
    a1 = _create(service, "tok-globex").session
    a2 = _create(service, "tok-globex").session
    assert a1.tenant_id == "globex" and a1.status == pb.common.SESSION_STATUS_OPEN
    got = stub.GetSession(
        pb.sessions.GetSessionRequest(session_id=a1.session_id), metadata=bearer("tok-globex")
    )
    assert got.session_id == a1.session_id
    # Another tenant gets NOT_FOUND (not PERMISSION_DENIED): ids do not leak across tenants.
    assert (
        _code(
            stub.GetSession,
            pb.sessions.GetSessionRequest(session_id=a1.session_id),
            metadata=bearer("tok-initech"),
        )
        == grpc.StatusCode.NOT_FOUND
    )
    page1 = stub.ListSessions(pb.sessions.ListSessionsRequest(page_size=1), metadata=bearer("tok-globex"))
    page2 = stub.ListSessions(
        pb.sessions.ListSessionsRequest(page_size=1, page_token=page1.next_page_token),
        metadata=bearer("tok-globex"),
    )
    assert [s.session_id for s in page1.sessions] + [s.session_id for s in page2.sessions] == [
        a1.session_id,
        a2.session_id,
    ]
    assert page2.next_page_token == ""
    closed = stub.CloseSession(
        pb.sessions.CloseSessionRequest(session_id=a2.session_id), metadata=bearer("tok-globex")
    )
    assert closed.status == pb.common.SESSION_STATUS_CLOSED
    open_only = stub.ListSessions(
        pb.sessions.ListSessionsRequest(open_only=True), metadata=bearer("tok-globex")
    )
    assert [s.session_id for s in open_only.sessions] == [a1.session_id]


def test_create_session_clips_retention_to_tenant_policy(service) -> None:
    pb = service.pb
    service.admin().SetRetentionPolicy(
        pb.admin.RetentionPolicy(tenant_id="acme", floor_s=60, ceiling_s=3600), metadata=bearer(ADMIN_TOKEN)
    )
    clipped = _create(service, "tok-acme", retention_s=86400)
    c = pb.common
    assert clipped.session.retention_s == 3600 and clipped.retention_outcome == c.RETENTION_OUTCOME_CLIPPED
    accepted = _create(service, "tok-acme", retention_s=600)
    assert accepted.session.retention_s == 600 and accepted.retention_outcome == c.RETENTION_OUTCOME_ACCEPTED
    defaulted = _create(service, "tok-acme")
    assert (
        defaulted.session.retention_s == 3600
        and defaulted.retention_outcome == c.RETENTION_OUTCOME_DEFAULTED
    )


def test_create_session_limit_is_resource_exhausted(tmp_path) -> None:
    from orchestrator.api import build_context, build_server
    from tests.orchestrator.api.conftest import make_settings

    ctx = build_context(make_settings(tmp_path))
    running = build_server(ctx, host="127.0.0.1", port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = ctx.stubs.sessions_grpc.SessionsStub(channel)
            req = ctx.stubs.sessions.CreateSessionRequest(model="small")
            for _ in range(5):
                stub.CreateSession(req, metadata=bearer("tok-acme"))
            assert (
                _code(stub.CreateSession, req, metadata=bearer("tok-acme"))
                == grpc.StatusCode.RESOURCE_EXHAUSTED
            )
    finally:
        running.stop(grace_s=None)
        ctx.close()


def test_auth_rejects_missing_unknown_and_wrong_kind_of_token(service) -> None:
    pb = service.pb
    req = pb.sessions.CreateSessionRequest(model="small")
    assert _code(service.sessions().CreateSession, req) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _code(service.sessions().CreateSession, req, metadata=bearer("nope"))
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert (
        _code(service.sessions().CreateSession, req, metadata=bearer(ADMIN_TOKEN))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert (
        _code(service.admin().VerifyAudit, pb.admin.VerifyAuditRequest(), metadata=bearer("tok-acme"))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    text = service.ctx.metrics.exposition().decode()
    assert (
        'kvresume_rpcs_total{code="UNAUTHENTICATED",method="/kvresume.v1.Sessions/CreateSession"} 2.0' in text
    )


def test_turn_rejects_bad_requests_before_running(service) -> None:
    pb, stub = service.pb, service.sessions()
    sid = _create(service, "tok-initech").session.session_id
    md = bearer("tok-initech")
    cases = {
        "empty": (
            pb.sessions.TurnRequest(session_id=sid, tokens=pb.sessions.TokenIds(ids=[])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "no input": (pb.sessions.TurnRequest(session_id=sid), grpc.StatusCode.INVALID_ARGUMENT),
        "too many tokens": (
            pb.sessions.TurnRequest(session_id=sid, tokens=pb.sessions.TokenIds(ids=[1] * 65)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        "bad top_p": (
            pb.sessions.TurnRequest(
                session_id=sid, text="hi", generation=pb.sessions.GenerationParams(top_p=1.5)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "max_new over limit": (
            pb.sessions.TurnRequest(
                session_id=sid, text="hi", generation=pb.sessions.GenerationParams(max_new_tokens=33)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        "unknown session": (pb.sessions.TurnRequest(session_id="nope", text="hi"), grpc.StatusCode.NOT_FOUND),
        "no engine": (pb.sessions.TurnRequest(session_id=sid, text="hi"), grpc.StatusCode.UNIMPLEMENTED),
        "over request size": (
            pb.sessions.TurnRequest(session_id=sid, text="x" * 70000),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    }
    got = {name: _code(stub.Turn, req, metadata=md) for name, (req, _) in cases.items()}
    assert got == {name: code for name, (_, code) in cases.items()}


def test_turn_streams_plan_then_tokens_then_stats(service, engine) -> None:
    pb, stub = service.pb, service.sessions()
    sid = _create(service, "tok-initech").session.session_id
    req = pb.sessions.TurnRequest(
        session_id=sid,
        tokens=pb.sessions.TokenIds(ids=[5, 6, 7]),
        request_id="req-1",
        generation=pb.sessions.GenerationParams(max_new_tokens=3),
    )
    with capture_logs() as logs:
        events = list(stub.Turn(req, metadata=bearer("tok-initech"), timeout=60))
    # The deadline travels as wall time; allow a second of skew against this process's clocks.
    assert 0 < engine.last_turn.deadline_monotonic - time.monotonic() <= 61
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["plan", "tokens", "tokens", "stats"]
    plan = events[0].plan
    assert plan.path == pb.common.RESUME_PATH_COLD_PREFILL
    assert plan.reason == "new session: no history to reuse"
    assert plan.reason_code == pb.common.PLAN_REASON_NEW_SESSION and plan.prompt_tokens == 3
    assert plan.counts.prefilled == 3 and plan.model == "small"
    assert [i for e in events[1:3] for i in e.tokens.ids] == [7, 6, 5]
    assert (
        events[-1].stats.generated_tokens == 3
        and events[-1].stats.finish_reason == pb.sessions.FINISH_REASON_LENGTH
    )
    lines = [entry for entry in logs if entry["event"] == "turn_completed"]
    assert len(lines) == 1
    line = lines[0]
    assert (line["session_id"], line["turn"], line["request_id"], line["path"], line["outcome"]) == (
        sid,
        0,
        "req-1",
        "COLD_PREFILL",
        "done",
    )
    assert (line["prefilled"], line["cached"], line["generated"]) == (3, 0, 3)
    text = service.ctx.metrics.exposition().decode()
    assert 'kvresume_turns_total{model="small",outcome="done",path="COLD_PREFILL"}' in text
    assert 'kvresume_rpcs_total{code="OK",method="/kvresume.v1.Sessions/Turn"}' in text
    assert "kvresume_running_turns 0.0" in text
    # Second turn: the history holds 6 tokens and the planner, with nothing stored, says why it is cold.
    second = list(
        stub.Turn(pb.sessions.TurnRequest(session_id=sid, text="ab"), metadata=bearer("tok-initech"))
    )
    assert engine.last_turn.deadline_monotonic is None and engine.last_turn.text == "ab"
    assert second[0].plan.reason == "nothing usable stored: store not wired in this test"
    assert second[0].plan.turn_index == 1 and second[0].plan.counts.prefilled == 8


def test_abort_cancels_the_running_turn(service, engine) -> None:
    pb, stub = service.pb, service.sessions()
    sid = _create(service, "tok-initech").session.session_id
    engine.block.set()
    stream = stub.Turn(
        pb.sessions.TurnRequest(session_id=sid, text="hello", request_id="req-abort"),
        metadata=bearer("tok-initech"),
    )
    first = next(stream)
    assert first.WhichOneof("event") == "plan"
    # A second turn on the same session while one runs is refused, with a machine-readable reason and
    # a retry delay.
    with pytest.raises(grpc.RpcError) as busy:
        list(stub.Turn(pb.sessions.TurnRequest(session_id=sid, text="x"), metadata=bearer("tok-initech")))
    details = error_details(busy.value)
    assert details.code == "FAILED_PRECONDITION" and details.reason == "TURN_RUNNING"
    assert details.retry_after_s is not None and details.retry_after_s > 0
    # Another tenant cannot abort it (the session reads as absent; its request id matches nothing of
    # theirs), nor cancel it by closing or deleting the id: a cancel would keep its first reason, so the
    # owner's reason below proves none happened.
    assert (
        _code(stub.Abort, pb.sessions.AbortRequest(session_id=sid), metadata=bearer("tok-acme"))
        == grpc.StatusCode.NOT_FOUND
    )
    assert not stub.Abort(
        pb.sessions.AbortRequest(request_id="req-abort"), metadata=bearer("tok-acme")
    ).aborted
    for call, request in (
        (stub.CloseSession, pb.sessions.CloseSessionRequest(session_id=sid)),
        (stub.DeleteSession, pb.sessions.DeleteSessionRequest(session_id=sid)),
    ):
        assert _code(call, request, metadata=bearer("tok-acme")) == grpc.StatusCode.NOT_FOUND
    # Neither id given is a usage error naming the field.
    with pytest.raises(grpc.RpcError) as empty:
        stub.Abort(pb.sessions.AbortRequest(), metadata=bearer("tok-initech"))
    assert error_details(empty.value).metadata == {"field": "session_id"}
    # By request id alone (what TurnRequest.request_id is for).
    answer = stub.Abort(
        pb.sessions.AbortRequest(request_id="req-abort", reason="user hit stop"),
        metadata=bearer("tok-initech"),
    )
    assert answer.aborted and answer.session_id == sid and answer.request_id == "req-abort"
    # The stream ends normally with the turn's record: ABORTED, nothing kept.
    rest = list(stream)
    assert [e.WhichOneof("event") for e in rest] == ["stats"]
    stats = rest[0].stats
    assert stats.finish_reason == pb.sessions.FINISH_REASON_ABORTED and not stats.kept
    assert stats.request_id == "req-abort" and not stats.persisted
    assert not stub.Abort(pb.sessions.AbortRequest(session_id=sid), metadata=bearer("tok-initech")).aborted
    assert len(service.ctx.running) == 0


def test_errors_carry_error_info_and_retry_info(service, engine) -> None:
    # No session is created here: the module's tenants are near their session limit.
    pb, stub = service.pb, service.sessions()
    too_long = pb.sessions.TurnRequest(
        session_id="any", tokens=pb.sessions.TokenIds(ids=[1] * (service.ctx.settings.max_turn_tokens + 1))
    )
    cases = [
        (
            lambda: stub.GetSession(
                pb.sessions.GetSessionRequest(session_id="nope"), metadata=bearer("tok-acme")
            ),
            ("NOT_FOUND", "SESSION_NOT_FOUND", None),
        ),
        (
            lambda: stub.GetSession(pb.sessions.GetSessionRequest(), metadata=bearer("tok-acme")),
            ("INVALID_ARGUMENT", "INVALID_ARGUMENT", "session_id"),
        ),
        (
            lambda: stub.GetSession(pb.sessions.GetSessionRequest(session_id="x"), metadata=bearer("bad")),
            ("UNAUTHENTICATED", "UNAUTHENTICATED", None),
        ),
        (
            lambda: list(stub.Turn(too_long, metadata=bearer("tok-acme"))),
            ("RESOURCE_EXHAUSTED", "REQUEST_TOO_LARGE", "tokens"),
        ),
    ]
    for call, (code, reason, field) in cases:
        with pytest.raises(grpc.RpcError) as info:
            call()
        d = error_details(info.value)
        assert (d.code, d.reason, d.metadata.get("field")) == (code, reason, field), d
        # RESOURCE_EXHAUSTED always says when a retry may help; these others say nothing.
        assert (d.retry_after_s is not None) == (code == "RESOURCE_EXHAUSTED"), d


def test_fork_and_delete_keep_shared_segments(service) -> None:
    import datetime as dt

    pb, stub, md = service.pb, service.sessions(), bearer("tok-acme")
    sid = _create(service, "tok-acme").session.session_id
    expires = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    with service.ctx.sessions() as s, s.begin():
        row = SessionRepository(s).get(sid, tenant_id="acme")
        turns = TurnRepository(s)
        for inp, out in [([1, 2, 3], [4]), ([5, 6], [7, 8])]:
            t = turns.begin(row, model="small", input_tokens=inp)
            turns.finish(t, row, output_tokens=out, timings=TurnTimings())
        segs = SegmentRepository(s)
        segs.link(
            sid,
            DurableSegment(
                store_key=b"k-first",
                tenant_id="acme",
                model="small",
                fingerprint="fp",
                start_pos=0,
                end_pos=4,
                nbytes=3560,
                expires_at=expires,
            ),
        )
        segs.link(
            sid,
            DurableSegment(
                store_key=b"k-second",
                tenant_id="acme",
                model="small",
                fingerprint="fp",
                start_pos=4,
                end_pos=8,
                nbytes=3560,
                expires_at=expires,
            ),
        )
    fork = stub.ForkSession(pb.sessions.ForkSessionRequest(session_id=sid, at_turn=1), metadata=md).session
    assert (fork.turn_count, fork.history_tokens, fork.parent_session_id, fork.forked_at_turn) == (
        1,
        4,
        sid,
        1,
    )
    with service.ctx.sessions() as s:
        assert SessionRepository(s).history(fork.session_id) == [1, 2, 3, 4]
    assert (
        _code(stub.ForkSession, pb.sessions.ForkSessionRequest(session_id=sid, at_turn=3), metadata=md)
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    # Deleting the parent frees only the chunk the fork does not share.
    deleted = stub.DeleteSession(pb.sessions.DeleteSessionRequest(session_id=sid), metadata=md)
    assert (deleted.segments_deleted, deleted.bytes_deleted) == (1, 3560)
    with service.ctx.sessions() as s:
        assert [seg.store_key for seg in SegmentRepository(s).for_session(fork.session_id)] == [b"k-first"]
    assert (
        _code(stub.GetSession, pb.sessions.GetSessionRequest(session_id=sid), metadata=md)
        == grpc.StatusCode.NOT_FOUND
    )
    records = service.ctx.audit.query(tenant="acme", action="purge")
    assert [(r.subject, r.nbytes, r.actor) for r in records][-1] == (f"session:{sid}", 3560, "tenant:acme")


def test_sessions_lifecycle_on_postgres(tmp_path, postgres_url) -> None:
    from orchestrator.api import build_context, build_server
    from tests.orchestrator.api.conftest import make_settings

    ctx = build_context(make_settings(tmp_path, database_url=postgres_url))
    running = build_server(ctx, host="127.0.0.1", port=0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            pb = ctx.stubs
            stub = pb.sessions_grpc.SessionsStub(channel)
            md = bearer("tok-acme")
            created = stub.CreateSession(pb.sessions.CreateSessionRequest(model="small"), metadata=md).session
            listed = stub.ListSessions(pb.sessions.ListSessionsRequest(), metadata=md)
            assert [s.session_id for s in listed.sessions] == [created.session_id]
            stub.DeleteSession(pb.sessions.DeleteSessionRequest(session_id=created.session_id), metadata=md)
            assert stub.ListSessions(pb.sessions.ListSessionsRequest(), metadata=md).sessions == []
            assert ctx.audit.verify().ok and ctx.audit.head()[0] == 1
    finally:
        running.stop(grace_s=None)
        ctx.close()


def test_turn_engine_that_skips_the_plan_is_an_internal_error(service) -> None:
    class NoPlan:
        def run_turn(self, turn, handle):
            yield TokenChunkEvent(ids=(1,))

    pb = service.pb
    sid = _create(service, "tok-initech").session.session_id
    service.ctx.turn_handler = NoPlan()
    try:
        code = _code(
            service.sessions().Turn,
            pb.sessions.TurnRequest(session_id=sid, text="x"),
            metadata=bearer("tok-initech"),
        )
    finally:
        service.ctx.turn_handler = None
    assert code == grpc.StatusCode.INTERNAL
    assert len(service.ctx.running) == 0
