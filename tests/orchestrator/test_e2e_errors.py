"""The service's failure behaviour over real gRPC (a SQLite file registry, and PostgreSQL when configured):
every status of the error table triggered by a real bad request, Abort and a concurrent second turn,
deadlines (each leaves the session at its last completed turn), two tenants isolated, residency (served
without persisting), sessions served in parallel.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from sqlalchemy import text
from sqlalchemy.engine import make_url

from kvresume import error_details
from orchestrator.api.turn_types import TokenChunkEvent
from orchestrator.db import SessionRepository, make_engine
from orchestrator.scheduler.chains import DecodeChain
from tests.orchestrator.engine.node_harness import (
    admin_md,
    continued_greedy,
    md,
    registry,
    run_turn,
    start_node,
)


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    torch.set_num_threads(1)
    url = None
    admin = schema = None
    if request.param == "postgres":
        # one schema for the module's node (the shared fixture makes one per test)
        server = request.getfixturevalue("postgres_server_url")
        schema = f"kvr_e2e_{uuid.uuid4().hex[:12]}"
        admin = make_engine(server)
        with admin.begin() as conn:
            conn.execute(text(f'create schema "{schema}"'))
        url = make_url(server).update_query_dict({"options": f"-csearch_path={schema}"})
        url = url.render_as_string(hide_password=False)
    n = start_node(
        tmp_path_factory.mktemp("errors"), registry(), database_url=url, max_sessions_per_tenant=50
    )
    try:
        yield n
    finally:
        n.stop()
        if admin is not None:
            with admin.begin() as conn:
                conn.execute(text(f'drop schema "{schema}" cascade'))
            admin.dispose()


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def _session(node, tenant: str = "acme", model: str = "a") -> str:
    pb = node.pb
    return node.sessions.CreateSession(
        pb.sessions.CreateSessionRequest(model=model), metadata=md(tenant)
    ).session.session_id


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return info.value.code()


def _turn_request(node, sid: str, ids: list[int], *, model: str = "", max_new: int = 2):
    pb = node.pb
    return pb.sessions.TurnRequest(
        session_id=sid,
        tokens=pb.sessions.TokenIds(ids=ids),
        model=model,
        generation=pb.sessions.GenerationParams(max_new_tokens=max_new),
    )


def _state(node, sid: str) -> tuple[int, list[int]]:
    with node.service.ctx.sessions() as s:
        row = SessionRepository(s).get(sid, tenant_id=None)
        return row.turn_count, SessionRepository(s).history(sid)


def test_turn_errors_map_to_status_codes(node) -> None:
    pb, st = node.pb, node.sessions
    sid = _session(node)
    ok = _ids(1, 10)
    assert _code(lambda: st.Turn(_turn_request(node, sid, ok))) == grpc.StatusCode.UNAUTHENTICATED
    assert (
        _code(lambda: node.admin.Purge(pb.admin.PurgeRequest(model="a"), metadata=md()))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    # token 512 is one past v41-tiny's vocabulary
    assert _code(lambda: st.Turn(_turn_request(node, sid, [20, 512]), metadata=md())) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert _code(lambda: st.Turn(_turn_request(node, "no-such-session", ok), metadata=md())) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert _code(lambda: st.Turn(_turn_request(node, sid, ok, model="not-served"), metadata=md())) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert _code(lambda: st.Turn(_turn_request(node, sid, _ids(2, 513)), metadata=md())) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    # none of the refused turns touched the session
    assert _state(node, sid) == (0, [])
    closed = _session(node)
    st.CloseSession(pb.sessions.CloseSessionRequest(session_id=closed), metadata=md())
    assert _code(lambda: st.Turn(_turn_request(node, closed, ok), metadata=md())) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    t = run_turn(node, sid, ok, max_new=2)
    assert t.path == "COLD_PREFILL"
    assert _state(node, sid)[0] == 1


def test_abort_and_a_concurrent_turn_leave_the_session_at_its_last_turn(node) -> None:
    pb, st = node.pb, node.sessions
    sid = _session(node)
    first = run_turn(node, sid, _ids(3, 40))
    before = _state(node, sid)
    assert before == (1, _ids(3, 40) + first.tokens)
    stream = st.Turn(_turn_request(node, sid, _ids(4, 8), max_new=60), metadata=md())
    events = iter(stream)
    assert next(events).WhichOneof("event") == "plan"
    assert next(events).WhichOneof("event") == "tokens"
    # the same session cannot run a second turn meanwhile
    with pytest.raises(grpc.RpcError) as busy:
        list(st.Turn(_turn_request(node, sid, _ids(5, 4)), metadata=md()))
    assert error_details(busy.value).reason == "TURN_RUNNING"
    aborted = st.Abort(pb.sessions.AbortRequest(session_id=sid, reason="user pressed stop"), metadata=md())
    assert aborted.aborted
    # the stream ends normally, with the turn's record: aborted, nothing of it kept
    rest = list(events)
    stats = rest[-1].stats
    assert rest[-1].WhichOneof("event") == "stats"
    assert stats.finish_reason == pb.sessions.FINISH_REASON_ABORTED and not stats.kept and not stats.persisted
    assert stats.generated_tokens == 1 + sum(len(e.tokens.ids) for e in rest[:-1])
    assert stats.prompt_tokens == len(before[1]) + 8
    assert _state(node, sid) == before
    # the next turn resumes from the last completed one: its stored KV and pool entry are intact
    t = run_turn(node, sid, _ids(6, 5))
    assert t.path == "FULL_HIT" and t.stats.counts.cached == len(before[1])


def test_abort_keep_partial_keeps_the_streamed_tokens(node) -> None:
    pb, st = node.pb, node.sessions
    sid = _session(node)
    first = run_turn(node, sid, _ids(30, 40))
    history = _ids(30, 40) + first.tokens
    new = _ids(31, 6)
    request = _turn_request(node, sid, new, max_new=60)
    request.request_id = "keep-me"
    events = iter(st.Turn(request, metadata=md()))
    plan = next(events).plan
    assert plan.prompt_tokens == len(history) + len(new)
    streamed = list(next(events).tokens.ids)
    answer = st.Abort(pb.sessions.AbortRequest(request_id="keep-me", keep_partial=True), metadata=md())
    assert answer.aborted and answer.session_id == sid and answer.request_id == "keep-me"
    for event in events:
        if event.WhichOneof("event") == "tokens":
            streamed += list(event.tokens.ids)
        else:
            stats = event.stats
    assert stats.finish_reason == pb.sessions.FINISH_REASON_ABORTED and stats.kept and stats.persisted
    assert stats.generated_tokens == len(streamed) < 60 and stats.request_id == "keep-me"
    # the kept tokens are the uninterrupted computation's (the session's state kept in memory), and they
    # joined the history
    turns = [(_ids(30, 40), len(first.tokens)), (new, len(streamed)), (_ids(32, 5), 3)]
    reference = continued_greedy(node.service.registry, "a", turns)
    assert streamed == reference[1]
    kept = history + new + streamed
    assert _state(node, sid) == (2, kept)
    # the whole kept history is stored (a partial tail chunk too; the next turn supersedes it)
    assert stats.stored_tokens == len(kept)
    # and the next turn resumes from it exactly, as a full hit
    t = run_turn(node, sid, _ids(32, 5))
    assert t.path == "FULL_HIT" and t.stats.counts.cached == len(kept)
    assert t.plan.reason_code == pb.common.PLAN_REASON_WINDOWS_IN_POOL
    assert t.tokens == reference[2]


def _resumes_exactly_after_a_kept_abort(
    node, sid: str, prompts: tuple[list[int], list[int], list[int]], first: list[int], streamed: list[int]
) -> None:
    """After a session's first turn (prompts[0], answered `first`) and a second turn (prompts[1]) aborted
    keeping `streamed`: those tokens are the uninterrupted computation's, the kept history is the
    session's, and a third turn (prompts[2]) resumes from it exactly, as a full hit."""
    turns = [(prompts[0], len(first)), (prompts[1], len(streamed)), (prompts[2], 3)]
    reference = continued_greedy(node.service.registry, "a", turns)
    assert streamed == reference[1]
    kept = prompts[0] + first + prompts[1] + streamed
    assert _state(node, sid) == (2, kept)
    t = run_turn(node, sid, prompts[2])
    assert t.path == "FULL_HIT" and t.stats.counts.cached == len(kept)
    assert t.tokens == reference[2]


def _noting_decode_passes(compute) -> tuple[str, Callable[..., Any], list[int]]:
    """The scheduler's decode passes as it sends them (a model process's apart, `start_decode_many`): the
    compute's method name, a stand-in for it that notes each pass's sequences and runs the pass, and the
    list it notes them in."""
    kind = "start_decode_many" if hasattr(compute, "start_decode_many") else "decode_many"
    real, sizes = getattr(compute, kind), []

    def noted(served, tokens, states, **kwargs):
        sizes.append(len(states))
        return real(served, tokens, states, **kwargs)

    return kind, noted, sizes


def test_abort_keep_partial_drains_the_decodes_its_chain_queued(node) -> None:
    """The Abort above while another session's long turn keeps the step loop busy: the aborted turn's
    decodes then run in the loop's steps, each queued by the turn's decode chain as the pass before it
    ended, ahead of the turn's thread. The Abort halts the chain; the turn keeps and streams every token
    sampled before that took effect, and its stored state covers exactly those (the next turn is a full
    hit equal to the uninterrupted computation)."""
    pb, st = node.pb, node.sessions
    compute = node.service.engine.scheduler.compute
    kind, noted, sizes = _noting_decode_passes(compute)
    sid, other = _session(node), _session(node)
    first = run_turn(node, sid, _ids(41, 30))
    new = _ids(42, 6)
    setattr(compute, kind, noted)  # (an instance attribute: the scheduler calls it for every decode pass)
    try:
        background = threading.Thread(
            target=run_turn, args=(node, other, _ids(40, 30)), kwargs={"max_new": 64}
        )
        background.start()
        request = _turn_request(node, sid, new, max_new=64)
        request.request_id = "drain-me"
        events = iter(st.Turn(request, metadata=md()))
        next(events)  # the plan
        streamed = list(next(events).tokens.ids)
        # both turns' decodes in one pass: the loop runs the steps, and the chains queue the decodes
        deadline = threading.Event()
        for _ in range(400):
            if 2 in sizes:
                break
            deadline.wait(0.01)
        assert 2 in sizes, sizes[:20]
        st.Abort(pb.sessions.AbortRequest(request_id="drain-me", keep_partial=True), metadata=md())
        for event in events:
            if event.WhichOneof("event") == "tokens":
                streamed += list(event.tokens.ids)
            else:
                stats = event.stats
        background.join(timeout=120)
    finally:
        delattr(compute, kind)
    assert stats.finish_reason == pb.sessions.FINISH_REASON_ABORTED and stats.kept and stats.persisted
    assert stats.generated_tokens == len(streamed) < 64
    _resumes_exactly_after_a_kept_abort(node, sid, (_ids(41, 30), new, _ids(43, 5)), first.tokens, streamed)


def test_abort_keep_partial_keeps_a_token_sampled_between_the_abort_and_the_halt(node, monkeypatch) -> None:
    """The race the test above leaves to timing, forced: the Abort lands while the turn's thread is
    between a token's event and its check for an Abort, and meanwhile the step loop ends the decode of
    that token (queued by the turn's chain) and samples the next one. The turn halts its chain too late
    for that token: it keeps and streams it (`TurnEngine._drain`), its stored state covers it, and the next
    turn is a full hit equal to the uninterrupted computation."""
    pb, st = node.pb, node.sessions
    compute = node.service.engine.scheduler.compute
    kind, noted, sizes = _noting_decode_passes(compute)
    max_new = 60  # the raced turn's (the background turn's is 64)
    aborted_at: list[int] = []  # tokens the raced turn had sampled when its Abort landed
    sampled_after = threading.Event()
    real_after = DecodeChain.after

    def after(chain, logits):
        step = real_after(chain, logits)
        raced = step is not None and chain._max_new_tokens == max_new
        if raced and aborted_at and chain.sampled > aborted_at[0]:
            sampled_after.set()
        return step

    convert = node.service.ctx.convert
    real_event = convert.turn_event
    seen = [0]

    def turn_event(event, *, request_id=""):
        if request_id == "race-me" and isinstance(event, TokenChunkEvent):
            seen[0] += len(event.ids)
            # once both turns share decode passes, the chain queues each decode as its token is sampled
            if not aborted_at and 2 in sizes:
                st.Abort(pb.sessions.AbortRequest(request_id="race-me", keep_partial=True), metadata=md())
                aborted_at.append(seen[0])
                assert sampled_after.wait(60), "the loop did not sample the next token"
        return real_event(event, request_id=request_id)

    sid, other = _session(node), _session(node)
    first = run_turn(node, sid, _ids(51, 30))
    new = _ids(52, 6)
    monkeypatch.setattr(compute, kind, noted, raising=False)
    monkeypatch.setattr(DecodeChain, "after", after)
    monkeypatch.setattr(convert, "turn_event", turn_event, raising=False)
    background = threading.Thread(target=run_turn, args=(node, other, _ids(50, 30)), kwargs={"max_new": 64})
    background.start()
    try:
        request = _turn_request(node, sid, new, max_new=max_new)
        request.request_id = "race-me"
        streamed: list[int] = []
        for event in st.Turn(request, metadata=md()):
            if event.WhichOneof("event") == "tokens":
                streamed += list(event.tokens.ids)
            elif event.WhichOneof("event") == "stats":
                stats = event.stats
    finally:
        background.join(timeout=120)
        monkeypatch.undo()
    assert aborted_at, sizes[:20]
    # the token sampled after the Abort (before the halt) is kept and streamed, after those before it
    assert len(streamed) > aborted_at[0] and stats.generated_tokens == len(streamed) < max_new
    assert stats.finish_reason == pb.sessions.FINISH_REASON_ABORTED and stats.kept and stats.persisted
    _resumes_exactly_after_a_kept_abort(node, sid, (_ids(51, 30), new, _ids(53, 5)), first.tokens, streamed)


def test_deadline_leaves_the_session_at_its_last_turn(node) -> None:
    st = node.sessions
    sid = _session(node)
    first = run_turn(node, sid, _ids(7, 45))
    before = _state(node, sid)
    with pytest.raises(grpc.RpcError) as info:
        list(st.Turn(_turn_request(node, sid, _ids(8, 6), max_new=60), metadata=md(), timeout=1.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # the server notices at its next step; wait for the turn to be released (bounded)
    done = threading.Event()
    for _ in range(200):
        if not node.service.ctx.running.running(sid):
            break
        done.wait(0.05)
    assert not node.service.ctx.running.running(sid)
    assert _state(node, sid) == before
    assert run_turn(node, sid, _ids(9, 4)).stats.counts.cached == len(_ids(7, 45) + first.tokens)


def test_two_tenants_are_isolated(node) -> None:
    pb, st = node.pb, node.sessions
    prompt = _ids(10, 50)
    mine = _session(node, "acme")
    t = run_turn(node, mine, prompt)
    history = prompt + t.tokens
    theirs = _session(node, "globex")
    # another tenant sees none of acme's sessions
    assert _code(
        lambda: st.GetSession(pb.sessions.GetSessionRequest(session_id=mine), metadata=md("globex"))
    ) == (grpc.StatusCode.NOT_FOUND)
    assert _code(lambda: st.Turn(_turn_request(node, mine, prompt), metadata=md("globex"))) == (
        grpc.StatusCode.NOT_FOUND
    )
    assert (
        _code(
            lambda: st.DeleteSession(pb.sessions.DeleteSessionRequest(session_id=mine), metadata=md("globex"))
        )
        == grpc.StatusCode.NOT_FOUND
    )
    # nor any of its stored KV: the same tokens under globex are a miss at token 0
    fp = node.service.registry.get("a").fingerprint_hex
    assert node.service.store.lookup("acme", fp, history).n_tokens == len(history)
    assert node.service.store.lookup("globex", fp, history).n_tokens == 0
    t2 = run_turn(node, theirs, prompt, tenant="globex")
    assert t2.path == "COLD_PREFILL" and t2.tokens == t.tokens
    # inside one tenant a fork shares the parent's stored chunks, and (no pool entry of its own yet) the
    # parent's pooled windows, which continue exactly the forked history: found by content, a full hit
    child = st.ForkSession(pb.sessions.ForkSessionRequest(session_id=mine, at_turn=1), metadata=md()).session
    t3 = run_turn(node, child.session_id, _ids(11, 5))
    assert t3.path == "FULL_HIT" and t3.stats.counts.cached == len(history)
    assert t3.plan.reason_code == pb.common.PLAN_REASON_WINDOWS_BY_CONTENT


def test_residency_serves_without_persisting(node) -> None:
    pb = node.pb
    answer = node.admin.SetResidencyPolicy(
        pb.admin.ResidencyPolicy(tenant_id="globex", allowed_regions=["us-9"]), metadata=admin_md()
    )
    # the admin is told at once that this node (eu-1) stops persisting the tenant's turns
    assert answer.node_region == "eu-1"
    assert "without persisting" in answer.warning and "eu-1" in answer.warning
    try:
        sid = _session(node, "globex")
        t = run_turn(node, sid, _ids(12, 40), tenant="globex")
        assert not t.plan.persist and "residency" in t.plan.persist_note and "residency" in t.plan.reason
        assert not t.stats.persisted
        t = run_turn(node, sid, _ids(13, 5), tenant="globex")
        assert t.path == "COLD_PREFILL" and t.stats.counts.prefilled == 40 + 3 + 5
        assert node.service.store.tenant_stats("globex").chunks == 0
    finally:
        back = node.admin.SetResidencyPolicy(
            pb.admin.ResidencyPolicy(tenant_id="globex"), metadata=admin_md()
        )
        assert back.warning == ""


def test_sessions_run_turns_in_parallel(node) -> None:
    sids = [_session(node) for _ in range(3)]
    results: dict[str, str] = {}

    def work(i: int, sid: str) -> None:
        results[sid] = run_turn(node, sid, _ids(20 + i, 30)).path

    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(sids)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert results == {s: "COLD_PREFILL" for s in sids}


def test_a_closed_store_is_unavailable(tmp_path: Path) -> None:
    n = start_node(tmp_path, registry())
    try:
        sid = _session(n)
        n.service.store.close()
        assert _code(lambda: n.sessions.Turn(_turn_request(n, sid, [20, 21]), metadata=md())) == (
            grpc.StatusCode.UNAVAILABLE
        )
    finally:
        n.channel.close()
        n.server.stop(grace_s=None)
        n.service.ctx.close()


def _details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return info.value.code(), info.value.details()


def test_unknown_and_oversized_names_are_refused_at_once(node) -> None:
    pb, st = node.pb, node.sessions

    def create(model: str):
        return lambda: st.CreateSession(pb.sessions.CreateSessionRequest(model=model), metadata=md())

    def sessions() -> int:
        with node.service.ctx.sessions() as s:
            return SessionRepository(s).count(tenant_id="acme")

    before = sessions()

    # an unknown model is refused at CreateSession, not at the first turn
    code, details = _details(create("not-served"))
    assert code == grpc.StatusCode.NOT_FOUND and "'not-served' is not served here (served: a, b)" in details
    # names past the registry's 128 characters are refused without echoing them (a 100 KB detail used to
    # overflow gRPC's metadata and come back as RESOURCE_EXHAUSTED)
    huge = "m" * (1 << 20)
    code, details = _details(create(huge))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "model of 1048576 characters exceeds the limit of 128"
    sid = _session(node)
    code, details = _details(lambda: st.Turn(_turn_request(node, sid, _ids(1, 5), model="x" * 100_000),
                                             metadata=md()))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "model of 100000 characters exceeds the limit of 128")
    code, details = _details(lambda: st.Turn(_turn_request(node, "s" * 100_000, _ids(1, 5)), metadata=md()))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "session_id of 100000 characters exceeds the limit of 128")
    assert _state(node, sid) == (0, [])
    assert sessions() == before + 1
