"""Decoded global KV kept beside pool entries, over real gRPC on loopback, a SQLite registry file and a
RocksDB store, with the trained v41-sib-s (W = 16, ratios 2/1; chunks of 32 tokens).

Narrations: the same turns on a node keeping decoded states, on one with the budget 0 (the import
path, the slow twin) and on one whose model runs in a process of its own (which keeps them there) give
the same tokens, the same pooled windows and the same stored chunk bytes, the full hits of the first and
the last served from kept state (hits counted, bytes gauged); the state a full hit starts
from is tensor for tensor the imported one; a purge, a pool expiry or another tenant never reaches kept
state.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import grpc
import pytest

from orchestrator.engine import ModelRegistry
from orchestrator.engine.payload_digests import PayloadDigests
from orchestrator.engine.prefix_reuse import find_reuse
from tests.orchestrator.engine.node_harness import (
    POOL_TTL_S,
    admin_md,
    md,
    new_session,
    run_turn,
    start_node,
    trained_ids,
    trained_registry,
)
from tests.orchestrator.engine.test_decoded_states import _assert_states_equal

MODEL = "v41-sib-s"


@pytest.fixture(scope="module")
def models() -> ModelRegistry:
    return trained_registry(MODEL)


def _ids(rng: random.Random, n: int) -> list[int]:
    return trained_ids(rng, n)


def _new_session(node, tenant: str = "acme") -> str:
    return new_session(node, MODEL, tenant)


def _lookups(node, result: str) -> float:
    value = node.service.ctx.metrics.registry.get_sample_value(
        "kvresume_decoded_state_lookups_total", {"result": result}
    )
    return value or 0.0


def test_kept_state_equals_the_import_path(tmp_path: Path, models) -> None:
    fp = models.get(MODEL).fingerprint_hex
    rng = random.Random(11)
    parts = [_ids(rng, 150)] + [_ids(rng, rng.randrange(5, 40)) for _ in range(4)]
    # the model in this process on these three (the states below are compared tensor for tensor here)
    on = start_node(tmp_path / "on", models, model_process="inline")
    off = start_node(tmp_path / "off", models, decoded_state_budget_bytes=0, model_process="inline")
    # kept state, but every chunk read and verified each turn (the twin of serving it unread)
    reads = start_node(tmp_path / "reads", models, model_process="inline")
    reads.service.engine._prep.kept_state_skips_reads = False
    # the model in a process of its own, which keeps the decoded state there (`RemoteKept` handles here)
    remote = start_node(tmp_path / "remote", models, model_process="separate")
    try:
        assert on.service.engine.decoded.enabled and not off.service.engine.decoded.enabled
        s_on, s_off, s_reads = _new_session(on), _new_session(off), _new_session(reads)
        s_remote = _new_session(remote)
        history: list[int] = []
        for k, part in enumerate(parts):
            a = run_turn(on, s_on, part, max_new=4)
            b = run_turn(off, s_off, part, max_new=4)
            c = run_turn(reads, s_reads, part, max_new=4)
            d = run_turn(remote, s_remote, part, max_new=4)
            assert a.path == b.path == c.path == d.path == ("COLD_PREFILL" if k == 0 else "FULL_HIT"), (
                a.plan.reason
            )
            assert a.tokens == b.tokens == c.tokens == d.tokens
            assert a.plan.reason == b.plan.reason == c.plan.reason == d.plan.reason
            history += part + a.tokens
            pooled = on.service.pool.get("acme", s_on)
            assert pooled == off.service.pool.get("acme", s_off) == reads.service.pool.get("acme", s_reads)
            assert pooled == remote.service.pool.get("acme", s_remote)
            stored = on.service.store.longest_valid_prefix("acme", fp, history).payloads
            assert stored and stored == off.service.store.longest_valid_prefix("acme", fp, history).payloads
            assert stored == reads.service.store.longest_valid_prefix("acme", fp, history).payloads
            assert stored == remote.service.store.longest_valid_prefix("acme", fp, history).payloads
        assert _lookups(on, "hit") == len(parts) - 1 and _lookups(on, "miss") == 0
        assert _lookups(reads, "hit") == len(parts) - 1
        # kept in the model process: served from there, unread, as in this process
        assert _lookups(remote, "hit") == len(parts) - 1 and _lookups(remote, "miss") == 0
        assert remote.service.store.stats().unread_chunk_hits == on.service.store.stats().unread_chunk_hits
        # the same entries; the model process's also pin each turn end's snapshot (its rings beside the
        # decoded KV: model_process/worker.py, `_KeptTurnEnd`), so they count more bytes
        kept_here, kept_there = on.service.engine.decoded.stats(), remote.service.engine.decoded.stats()
        assert kept_there.entries == kept_here.entries > 0
        assert kept_there.bytes_used > kept_here.bytes_used
        assert off.service.engine.decoded.stats().hits == 0
        # the full hits after the first were served unread on `on`, read and verified on `reads`
        assert on.service.store.stats().unread_chunk_hits > 0
        assert reads.service.store.stats().unread_chunk_hits == 0
        unread = on.service.ctx.metrics.registry.get_sample_value("kvresume_store_unread_chunk_hits_total")
        assert unread == on.service.store.stats().unread_chunk_hits
        kept = on.service.engine.decoded.stats()
        assert kept.entries == 1 and kept.bytes_used > 0
        assert (
            on.service.ctx.metrics.registry.get_sample_value("kvresume_decoded_state_bytes")
            == kept.bytes_used
        )

        # the state the next full hit starts from: kept (fast) against imported (slow), on the same node
        engine = on.service.engine
        served = engine.registry.get(MODEL)
        nxt = _ids(rng, 9)

        def reuse(decoded, digests=None, skip_reads=True):
            return find_reuse(
                engine.store,
                engine.pool,
                on.service.ctx.sessions,
                engine.compute,
                tenant="acme",
                session_id=s_on,
                served=served,
                history=history,
                new_tokens=nxt,
                last_model=MODEL,
                decoded=decoded,
                digests=digests,
                kept_state_skips_reads=skip_reads,
            )

        fast, slow = reuse(engine.decoded), reuse(None)
        assert fast.pooled_prefix is not None and fast.pooled_prefix.decoded
        assert slow.pooled_prefix is not None and not slow.pooled_prefix.decoded
        assert fast.pooled_prefix.blobs == slow.pooled_prefix.blobs
        _assert_states_equal(fast.full_hit_state, slow.full_hit_state)
        _assert_states_equal(fast.prefix.state, slow.prefix.state)
        # served unread: the same prefix without its payloads, and a miss of the digests reads them
        digests = engine._prep.digests
        unread, read = reuse(engine.decoded, digests), reuse(engine.decoded, digests, skip_reads=False)
        for got in (unread, read):
            assert got.pooled_prefix is not None and got.pooled_prefix.decoded
        assert not unread.pooled_prefix.payloads_read and unread.pooled_prefix.blobs == []
        assert read.pooled_prefix.payloads_read and read.pooled_prefix.blobs == slow.pooled_prefix.blobs
        for a, b in ((unread.prefix, slow.prefix), (unread.pooled_prefix, slow.pooled_prefix)):
            assert (a.n_tokens, a.ranges, a.miss_reason, a.lookup_result) == (
                b.n_tokens,
                b.ranges,
                b.miss_reason,
                b.lookup_result,
            )
            assert a.payload_hashes() == b.payload_hashes()
        _assert_states_equal(unread.full_hit_state, slow.full_hit_state)
        _assert_states_equal(unread.prefix.state, slow.prefix.state)
        cold = reuse(engine.decoded, PayloadDigests())  # no digest kept: the chunks are read
        assert cold.pooled_prefix is not None and cold.pooled_prefix.payloads_read
        _assert_states_equal(cold.full_hit_state, slow.full_hit_state)
    finally:
        on.stop()
        off.stop()
        reads.stop()
        remote.stop()


def test_purge_expiry_and_other_tenants_never_reach_kept_state(tmp_path: Path, models) -> None:
    _purge_expiry_isolation(tmp_path, models, None)


def test_purge_expiry_and_other_tenants_never_reach_kept_state_postgres(
    tmp_path: Path, models, postgres_url: str
) -> None:
    _purge_expiry_isolation(tmp_path, models, postgres_url)


def _purge_expiry_isolation(tmp_path: Path, models, database_url: str | None) -> None:
    rng = random.Random(12)
    node = start_node(tmp_path, models, database_url=database_url)
    pb = node.pb
    decoded = node.service.engine.decoded
    try:
        prompt = _ids(rng, 120)
        a = _new_session(node)
        ta = run_turn(node, a, prompt)
        assert decoded.stats().entries == 1
        # another tenant with the same conversation: nothing of acme's is found
        g = _new_session(node, tenant="globex")
        tg = run_turn(node, g, prompt + ta.tokens + _ids(rng, 5), tenant="globex")
        assert tg.path == "COLD_PREFILL" and decoded.stats().hits == 0

        # purge of the session: its kept state goes with its pool entry, before any turn; a new session
        # carrying the purged conversation (found by content otherwise) starts cold
        node.admin.Purge(pb.admin.PurgeRequest(session_id=a), metadata=admin_md())
        assert decoded.stats().entries == 1  # globex's only
        t = run_turn(node, _new_session(node), prompt + ta.tokens + _ids(rng, 6))
        assert t.path == "COLD_PREFILL" and decoded.stats().hits == 0

        # pool expiry: the next turn finds no pooled windows and the kept state is dropped with them
        b = _new_session(node)
        run_turn(node, b, _ids(rng, 70))
        t = run_turn(node, b, _ids(rng, 7))
        assert t.path == "FULL_HIT" and decoded.stats().hits == 1
        node.pool_clock.now += POOL_TTL_S + 1
        t = run_turn(node, b, _ids(rng, 7))
        assert t.path == "GLOBAL_REPLAY" and decoded.stats().hits == 1
        # the expired entries (globex's too: its clock moved as well) left with their pool entries; the
        # turn just run kept its own
        assert decoded.stats().entries == node.service.pool.stats().entries == 1

        # tenant purge
        node.admin.Purge(pb.admin.PurgeRequest(tenant_id="acme"), metadata=admin_md())
        assert decoded.stats().entries == node.service.pool.stats().entries == 0
        assert decoded.stats().bytes_used == 0
    finally:
        node.stop()


def test_a_model_process_lost_at_the_turn_end_fails_it_before_its_commit(tmp_path: Path, models) -> None:
    """The model process dies as a turn takes its end from the state (its one call there before the put:
    the chunks it writes, the windows and the kept state): the turn fails with nothing of it in the
    history or the store (the session's length and the stored chunks unchanged); nothing runs against the
    model process after a commit, so no committed turn can fail that way. The same turn sent again runs on
    a new model process, and it and the next turn give the tokens an uninterrupted node gives."""
    rng = random.Random(5)
    parts = [_ids(rng, 120), _ids(rng, 20), _ids(rng, 15)]
    node = start_node(tmp_path / "separate", models, model_process="separate")
    reference = start_node(tmp_path / "inline", models, model_process="inline")
    try:
        sid, ref = _new_session(node), _new_session(reference)
        compute = node.service.engine.compute
        export_turn_end = compute.export_turn_end

        def dies_first(served, state, ranges, *, keep):
            os.kill(compute._proc.proc.pid, signal.SIGKILL)  # noqa: SLF001 - the model process dies here
            compute._proc.proc.wait()  # noqa: SLF001
            return export_turn_end(served, state, ranges, keep=keep)

        first, want = run_turn(node, sid, parts[0], max_new=4), run_turn(reference, ref, parts[0], max_new=4)
        assert first.tokens == want.tokens
        chunks = node.service.store.stats().chunks
        compute.export_turn_end = dies_first
        try:
            with pytest.raises(grpc.RpcError) as failed:
                run_turn(node, sid, parts[1], max_new=4)
        finally:
            compute.export_turn_end = export_turn_end
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        asked = node.pb.sessions.GetSessionRequest(session_id=sid)
        got = node.sessions.GetSession(asked, metadata=md("acme"))
        assert got.turn_count == 1
        assert node.service.store.stats().chunks == chunks
        second, want = run_turn(node, sid, parts[1], max_new=4), run_turn(reference, ref, parts[1], max_new=4)
        assert second.tokens == want.tokens and second.stats.persisted
        third, want = run_turn(node, sid, parts[2], max_new=4), run_turn(reference, ref, parts[2], max_new=4)
        assert third.path == "FULL_HIT", third.plan.reason
        assert third.tokens == want.tokens
        assert compute.running(compute._proc.generation) and compute._proc.generation == 2  # noqa: SLF001
    finally:
        node.stop()
        reference.stop()
