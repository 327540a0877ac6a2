"""Metrics and the canonical turn line over a real in-process server: the model label, generated tokens
and inter-token latency, persist failures, a client disconnect counted as CANCELLED, tenant and finish
reason in `turn_completed`, the storage counters read from a real pool and store, build info and the
default metrics port. The turn engine is a scripted stand-in (no model), so every number is exact.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from orchestrator.api import (
    FinishReason,
    PlanEvent,
    PoolStats,
    TokenChunkEvent,
    TurnHandle,
    TurnInput,
    TurnStatsEvent,
    build_context,
)
from orchestrator.api.metrics import package_version
from orchestrator.db import SessionRepository
from orchestrator.planner import (
    BUILTIN_COSTS,
    CacheInventory,
    ModelGeometry,
    PoolState,
    SessionView,
    plan_turn,
)
from orchestrator.settings import Settings
from storage import GlobalKVStore, PoolConfig, RetentionPolicy, StoreConfig, WindowPool
from tests.orchestrator.api.conftest import bearer, make_settings

TURN = "/kvresume.v1.Sessions/Turn"


class ScriptedEngine:
    """Plans with the real planner (nothing stored: cold), then streams `chunks` and one stats event.

    `mode` says how the turn ends: "done"; "disconnect" (after the first chunk it waits until the
    client has gone, then yields again, which makes gRPC close the stream); "fail" (raises after the
    first chunk, before any stats).
    """

    def __init__(
        self,
        ctx,
        *,
        chunks: list[tuple[int, ...]],
        mode: str = "done",
        persist: bool = True,
        persisted: bool = True,
        finish: FinishReason = FinishReason.STOP,
    ) -> None:
        self._ctx = ctx
        self.chunks, self.mode = chunks, mode
        self.persist, self.persisted, self.finish = persist, persisted, finish
        self.closed = threading.Event()

    def run_turn(self, turn: TurnInput, handle: TurnHandle) -> Iterator:
        tokens = list(turn.tokens or turn.text.encode())
        with self._ctx.sessions() as s:
            row = SessionRepository(s).get(turn.session_id, tenant_id=turn.tenant_id)
            view = SessionView(
                session_id=row.id,
                tenant_id=row.tenant_id,
                history_len=0,
                new_tokens=len(tokens),
                last_model=None,
            )
            model = turn.model or row.model
        plan = plan_turn(
            view,
            model=model,
            geometry=ModelGeometry(window=8, group=4),
            cache=CacheInventory.empty(model, "nothing stored in this test"),
            pool=PoolState.absent(),
            costs=BUILTIN_COSTS,
        )
        plan = dataclasses.replace(plan, persist=self.persist)
        try:
            yield PlanEvent(plan=plan, turn_index=0)
            yield TokenChunkEvent(ids=self.chunks[0])
            if self.mode == "disconnect":
                assert handle.wait(30), "the client's cancel never reached the server"
            if self.mode == "fail":
                raise RuntimeError("scripted failure after the first token")
            for ids in self.chunks[1:]:
                yield TokenChunkEvent(ids=ids)
            yield TurnStatsEvent(
                turn_index=0,
                ttft_s=0.25,
                decode_tokens_per_s=100.0,
                counts=plan.counts,
                generated_tokens=sum(len(c) for c in self.chunks),
                finish_reason=self.finish,
                total_s=0.5,
                persisted=self.persisted,
            )
        finally:
            self.closed.set()


@pytest.fixture
def use_engine(service):
    def install(**kwargs) -> ScriptedEngine:
        engine = ScriptedEngine(service.ctx, **kwargs)
        service.ctx.turn_handler = engine
        return engine

    yield install
    service.ctx.turn_handler = None


def _session(service, tenant_token: str, model: str) -> str:
    req = service.pb.sessions.CreateSessionRequest(model=model)
    return service.sessions().CreateSession(req, metadata=bearer(tenant_token)).session.session_id


def _turn(service, sid: str, tenant_token: str = "tok-initech"):
    pb = service.pb
    req = pb.sessions.TurnRequest(session_id=sid, tokens=pb.sessions.TokenIds(ids=[5, 6, 7]))
    return service.sessions().Turn(req, metadata=bearer(tenant_token), timeout=60)


def _value(service, name: str, **labels: str) -> float:
    return service.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


def _turn_line(logs: list[dict]) -> dict:
    lines = [entry for entry in logs if entry["event"] == "turn_completed"]
    assert len(lines) == 1, lines
    return lines[0]


def test_turn_metrics_carry_the_model_label_and_count_generated_tokens(service, use_engine) -> None:
    use_engine(chunks=[(1, 2), (3,), (4,)])
    sid = _session(service, "tok-initech", "m-label")
    events = list(_turn(service, sid))
    assert [e.WhichOneof("event") for e in events] == ["plan", "tokens", "tokens", "tokens", "stats"]
    by_model = {"model": "m-label", "path": "COLD_PREFILL"}
    assert _value(service, "kvresume_turns_total", outcome="done", **by_model) == 1
    assert _value(service, "kvresume_turn_tokens_total", model="m-label", kind="prefilled") == 3
    assert _value(service, "kvresume_ttft_seconds_count", **by_model) == 1
    assert _value(service, "kvresume_ttft_seconds_sum", **by_model) == 0.25
    assert _value(service, "kvresume_turn_seconds_count", **by_model) == 1
    assert _value(service, "kvresume_generated_tokens_total", model="m-label") == 4
    # three chunks streamed: two gaps between them
    assert _value(service, "kvresume_inter_token_seconds_count", model="m-label") == 2
    assert _value(service, "kvresume_persist_failures_total", model="m-label") == 0
    text = service.ctx.metrics.exposition().decode()
    assert 'kvresume_turns_total{model="m-label",outcome="done",path="COLD_PREFILL"} 1.0' in text


def test_persist_failure_counts_a_refused_store_not_residency(service, use_engine) -> None:
    # The plan meant to persist, and the store did not take the chunks: a persist failure.
    use_engine(chunks=[(1,)], persist=True, persisted=False)
    list(_turn(service, _session(service, "tok-initech", "m-persist")))
    assert _value(service, "kvresume_persist_failures_total", model="m-persist") == 1
    # Residency forbade persisting from the start (plan.persist False): nothing failed.
    use_engine(chunks=[(1,)], persist=False, persisted=False)
    list(_turn(service, _session(service, "tok-initech", "m-persist")))
    # A stored turn is no failure either.
    use_engine(chunks=[(1,)], persist=True, persisted=True)
    list(_turn(service, _session(service, "tok-initech", "m-persist")))
    assert _value(service, "kvresume_persist_failures_total", model="m-persist") == 1
    assert (
        _value(service, "kvresume_turns_total", model="m-persist", path="COLD_PREFILL", outcome="done") == 3
    )


def test_turn_completed_logs_tenant_and_finish_reason(service, use_engine) -> None:
    use_engine(chunks=[(1,), (2,)], finish=FinishReason.LENGTH)
    sid = _session(service, "tok-globex", "m-log")
    with capture_logs() as logs:
        list(_turn(service, sid, "tok-globex"))
    line = _turn_line(logs)
    assert (line["session_id"], line["tenant"], line["outcome"], line["finish_reason"]) == (
        sid,
        "globex",
        "done",
        "length",
    )
    assert line["ttft_s"] == 0.25 and line["generated"] == 2


def test_turn_completed_of_a_failed_turn_has_no_finish_reason_and_its_measured_ttft(
    service, use_engine
) -> None:
    use_engine(chunks=[(1,)], mode="fail")
    sid = _session(service, "tok-globex", "m-fail")
    with capture_logs() as logs, pytest.raises(grpc.RpcError) as info:
        list(_turn(service, sid, "tok-globex"))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    line = _turn_line(logs)
    assert (line["tenant"], line["outcome"], line["finish_reason"], line["generated"]) == (
        "globex",
        "failed",
        None,
        1,
    )
    # one token was streamed before the failure, so its time to first token was measured
    assert line["ttft_s"] is not None and 0 < line["ttft_s"] <= line["total_s"]
    assert _value(service, "kvresume_rpcs_total", method=TURN, code="INTERNAL") >= 1


def test_client_disconnect_counts_as_cancelled_and_logs_the_aborted_turn(service, use_engine) -> None:
    engine = use_engine(chunks=[(1,), (2,)], mode="disconnect")
    sid = _session(service, "tok-initech", "m-gone")
    cancelled_before = _value(service, "kvresume_rpcs_total", method=TURN, code="CANCELLED")
    unknown_before = _value(service, "kvresume_rpcs_total", method=TURN, code="UNKNOWN")
    with capture_logs() as logs:
        stream = _turn(service, sid)
        assert next(stream).WhichOneof("event") == "plan"
        assert next(stream).WhichOneof("event") == "tokens"
        stream.cancel()
        # The server learns of the cancel, yields once more and gRPC closes its stream (GeneratorExit);
        # the counter moves when the interceptor's wrapper unwinds, just after the engine's.
        assert engine.closed.wait(30)
        counted = threading.Event()
        for _ in range(600):
            if _value(service, "kvresume_rpcs_total", method=TURN, code="CANCELLED") > cancelled_before:
                break
            counted.wait(0.05)
    assert _value(service, "kvresume_rpcs_total", method=TURN, code="CANCELLED") == cancelled_before + 1
    assert _value(service, "kvresume_rpcs_total", method=TURN, code="UNKNOWN") == unknown_before
    line = _turn_line(logs)
    assert (line["tenant"], line["outcome"], line["finish_reason"]) == ("initech", "aborted", "aborted")
    # gRPC closes the stream at the first yield after it saw the cancel: the first chunk's when the cancel
    # came before its send returned, else the second's (generated and handed to gRPC, never sent).
    assert line["generated"] in (1, 2)
    assert line["ttft_s"] is not None and line["ttft_s"] > 0
    by_model = {"model": "m-gone", "path": "COLD_PREFILL"}
    assert _value(service, "kvresume_turns_total", outcome="aborted", **by_model) == 1
    assert _value(service, "kvresume_ttft_seconds_count", **by_model) == 1
    assert _value(service, "kvresume_generated_tokens_total", model="m-gone") == line["generated"]
    assert len(service.ctx.running) == 0


@dataclasses.dataclass
class _Clock:
    now: float

    def __call__(self) -> float:
        return self.now


def test_storage_counters_read_the_pool_and_the_store(tmp_path: Path) -> None:
    hour = 3600.0
    pool_clock = _Clock(100.0)
    pool = WindowPool(PoolConfig(budget_bytes=1000, ttl_s=60.0), clock=pool_clock)

    def pool_stats() -> PoolStats:
        p = pool.stats()
        return PoolStats(
            bytes_used=p.bytes_used,
            budget_bytes=p.budget_bytes,
            entries=p.entries,
            expired=p.expired,
            evicted_lru=p.evicted_lru,
            refused=p.refused,
        )

    ctx = build_context(make_settings(tmp_path, kv_capacity_bytes=3 * 300), pool_stats=pool_stats)
    clock = _Clock(1_800_000_000.0)
    store = GlobalKVStore(
        StoreConfig(
            path=str(tmp_path / "kv"), chunk_tokens=8, compression_ratios=(4,), capacity_bytes=3 * 300
        ),
        clock=clock,
    )
    m = ctx.metrics.registry
    try:
        # Before the store is attached, its counters are absent (not zero).
        assert m.get_sample_value("kvresume_store_evicted_chunks_total") is None
        ctx.store_stats = store.stats
        # Pool: a third 400-byte entry evicts the least recently used one; past the TTL one expires.
        for session in ("s1", "s2", "s3"):
            assert pool.put("acme", session, b"x" * 400).stored
        assert not pool.put("acme", "big", b"x" * 1001).stored
        pool_clock.now += 61.0
        pool.get("acme", "s3")
        # Store: chunks inside their floor refuse a write for capacity; past the floor they are evicted;
        # past the ceiling maintenance deletes them.
        store.set_policy("acme", RetentionPolicy(floor_s=hour, ceiling_s=10 * hour), actor="test")
        a, b = list(range(1, 17)), list(range(101, 117))
        full = {(0, 8): os.urandom(200), (8, 16): os.urandom(200)}
        assert store.put_chunks("acme", "s1", "fp", a, full).persisted
        assert not store.put_chunks("acme", "s2", "fp", b, full).persisted
        clock.now += hour + 1
        assert store.put_chunks("acme", "s2", "fp", b, full).evicted_chunks == 2
        clock.now += 10 * hour
        assert store.run_maintenance().expired_chunks == 2
        assert m.get_sample_value("kvresume_pool_evictions_total", {"cause": "budget"}) == 1
        assert m.get_sample_value("kvresume_pool_evictions_total", {"cause": "ttl"}) == 1
        assert m.get_sample_value("kvresume_pool_refused_puts_total") == 1
        assert m.get_sample_value("kvresume_store_evicted_chunks_total") == 2
        assert m.get_sample_value("kvresume_store_expired_chunks_total") == 2
        assert m.get_sample_value("kvresume_store_unread_chunk_hits_total") == 0
        assert m.get_sample_value("kvresume_store_refusals_total", {"kind": "capacity"}) == 1
        assert m.get_sample_value("kvresume_store_refusals_total", {"kind": "residency"}) == 0
        assert m.get_sample_value("kvresume_store_capacity_bytes") == 3 * 300
        # The exposition is valid text with the counters typed as counters.
        text = ctx.metrics.exposition().decode()
        assert "# TYPE kvresume_store_evicted_chunks_total counter" in text
        assert 'kvresume_pool_evictions_total{cause="ttl"} 1.0' in text
    finally:
        store.close()
        ctx.close()


def test_build_info_and_the_default_metrics_port(tmp_path: Path) -> None:
    # 9090 is Prometheus's own port; the service's default sits beside gRPC's 50051.
    assert Settings().metrics_port == 50052
    ctx = build_context(make_settings(tmp_path, model_numerics="native", model_kernel_backend="triton"))
    try:
        labels = {
            "version": package_version(),
            "numerics": "native",
            "device": "cpu",
            "kernel_backend": "triton",
        }
        assert ctx.metrics.registry.get_sample_value("kvresume_build_info", labels) == 1
        assert package_version() != "" and package_version("no-such-distribution-kvresume") == "unknown"
        ctx.metrics.set_served_models({"a": {"source": "random:v41-tiny@1", "fingerprint": "ab12"}})
        info = {"model": "a", "source": "random:v41-tiny@1", "fingerprint": "ab12"}
        assert ctx.metrics.registry.get_sample_value("kvresume_served_model_info", info) == 1
    finally:
        ctx.close()


def test_a_serving_node_wires_store_pool_and_served_models(tmp_path: Path) -> None:
    from orchestrator.api import build_server
    from orchestrator.engine import build_node
    from tests.orchestrator.engine.node_harness import TOKENS, ManualClock, Node, md, registry, run_turn

    settings = Settings(
        data_dir=tmp_path,
        database_url=f"sqlite:///{tmp_path / 'registry.sqlite3'}",
        tenant_tokens=TOKENS,
        grpc_port=0,
        metrics_enabled=False,
        region="eu-1",
        kv_chunk_tokens=32,
        kv_capacity_bytes=1 << 30,
        pool_budget_bytes=64 << 20,
        max_new_tokens=8,
    )
    clock = ManualClock()
    service = build_node(settings, registry=registry(), pool_clock=clock, preload=True)
    server = build_server(service.ctx, host="127.0.0.1", port=0)
    node = Node(
        service=service,
        server=server,
        channel=grpc.insecure_channel(f"127.0.0.1:{server.port}"),
        pool_clock=clock,
    )
    m = service.ctx.metrics.registry
    try:
        for name, seed in (("a", 1), ("b", 2)):
            info = {
                "model": name,
                "source": f"random:v41-tiny@{seed}",
                "fingerprint": service.registry.get(name).fingerprint_hex,
            }
            assert m.get_sample_value("kvresume_served_model_info", info) == 1
        pb = node.pb
        sid = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md()).session
        t = run_turn(node, sid.session_id, list(range(1, 41)), max_new=4)
        assert t.stats.persisted and len(t.tokens) == 4
        assert m.get_sample_value("kvresume_generated_tokens_total", {"model": "a"}) == 4
        assert m.get_sample_value("kvresume_inter_token_seconds_count", {"model": "a"}) == 3
        by_model = {"model": "a", "path": "COLD_PREFILL"}
        assert m.get_sample_value("kvresume_turns_total", {**by_model, "outcome": "done"}) == 1
        assert m.get_sample_value("kvresume_persist_failures_total", {"model": "a"}) is None
        # The store and the pool are read at scrape time through the context.
        assert m.get_sample_value("kvresume_store_evicted_chunks_total") == 0
        assert m.get_sample_value("kvresume_store_expired_chunks_total") == 0
        assert m.get_sample_value("kvresume_store_refusals_total", {"kind": "capacity"}) == 0
        assert m.get_sample_value("kvresume_pool_evictions_total", {"cause": "ttl"}) == 0
        assert m.get_sample_value("kvresume_pool_entries") == 1
        assert m.get_sample_value("kvresume_store_capacity_bytes") == 1 << 30
        # Past the pool's TTL the entry expires on the next turn's lookup: a ttl eviction.
        clock.now += settings.pool_ttl_s + 1
        run_turn(node, sid.session_id, [7, 8, 9], max_new=2)
        assert m.get_sample_value("kvresume_pool_evictions_total", {"cause": "ttl"}) == 1
    finally:
        node.stop()


def test_service_metrics_child_is_the_labels_child_and_counts_alike() -> None:
    """`ServiceMetrics.child` keeps what `labels()` returns; its slow twin is `labels()` itself: both
    update the same series, in any keyword order."""
    import random

    from orchestrator.api import ServiceMetrics

    fast, slow = ServiceMetrics(), ServiceMetrics()
    rng = random.Random()
    for _ in range(500):
        model, path = rng.choice(["m", "m2", "é"]), rng.choice(["FULL_HIT", "COLD_PREFILL"])
        n, secs = rng.randrange(0, 100), rng.random()
        fast.child(fast.turn_tokens, model=model, kind=path).inc(n)
        slow.turn_tokens.labels(model=model, kind=path).inc(n)
        fast.child(fast.turn_latency, path=path, model=model).observe(secs)
        slow.turn_latency.labels(model=model, path=path).observe(secs)
        fast.child(fast.scheduler_waiting, model=model).set(n)
        slow.scheduler_waiting.labels(model=model).set(n)

    def samples(m: ServiceMetrics) -> list[tuple[str, tuple, float]]:
        # every sample but the `_created` stamps (each registry's own clock)
        return sorted(
            (x.name, tuple(sorted(x.labels.items())), x.value)
            for family in m.registry.collect()
            for x in family.samples
            if not x.name.endswith("_created")
        )

    assert samples(fast) == samples(slow) and samples(fast)
    assert fast.child(fast.turns, model="m", path="p", outcome="o") is fast.turns.labels("m", "p", "o")
    with pytest.raises(AssertionError, match="served_model_info"):
        fast.child(fast.served_model_info, model="m", source="s", fingerprint="f")
