"""Content-addressed prefix reuse over real gRPC on loopback, a SQLite registry file and a RocksDB store,
with the trained v41-sib-s (W = 16, ratios 2/1; chunks of 32 tokens).

Narrations: a new session repeating another's prompt loads its stored chunks (GLOBAL_REPLAY, not a cold
start); the stateless agent pattern (every request a fresh session carrying the whole conversation) is a
FULL_HIT from the second request on, bit-identical to one session continued on a second node (tokens,
pooled windows and stored chunk bytes); an edited history shares up to the edit; a purge of the writer
leaves the reader whole; another tenant finds nothing; chunks no committed turn names are never served;
a new session on another model than the one that stored its prompt follows the model-swap rules.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mappers import identity_mapper, read_metadata, save_mapper
from orchestrator.db import SegmentRepository, SessionRepository
from orchestrator.engine import ModelRegistry, pack_pool_entry, unpack_pool_entry
from storage import ContentKey
from tests.orchestrator.engine.node_harness import (
    admin_md,
    counts,
    md,
    new_session,
    run_turn,
    start_node,
    trained_ids,
    trained_registry,
)
from tests.orchestrator.engine.node_harness import registry as harness_registry

MODEL = "v41-sib-s"
CHUNK = 32
WINDOW = 16


@pytest.fixture(scope="module")
def models() -> ModelRegistry:
    return trained_registry(MODEL)


def _ids(rng: random.Random, n: int) -> list[int]:
    return trained_ids(rng, n)


def _new_session(node, tenant: str = "acme") -> str:
    return new_session(node, MODEL, tenant)


def _reason(node, t) -> str:
    return node.pb.common.PlanReason.Name(t.plan.reason_code).removeprefix("PLAN_REASON_")


def _stored_payloads(node, tenant: str, fp: str, history: list[int]) -> list[bytes]:
    return node.service.store.longest_valid_prefix(tenant, fp, history).payloads


def test_new_session_repeating_a_prompt_reuses_the_stored_chunks(tmp_path: Path, models) -> None:
    rng = random.Random(1)
    node = start_node(tmp_path, models)
    try:
        prompt = _ids(rng, 300)
        a = _new_session(node)
        first = run_turn(node, a, prompt)
        assert first.path == "COLD_PREFILL" and _reason(node, first) == "NEW_SESSION"
        # the same 300-token prompt in a new session: the 288 tokens of A's full chunks are loaded by
        # content (A's 15-token tail reaches past the prompt's last token, which is always computed)
        b = _new_session(node)
        second = run_turn(node, b, prompt)
        assert second.path == "GLOBAL_REPLAY", second.plan.reason
        assert _reason(node, second) == "PREFIX_BY_CONTENT"
        assert (
            counts(second.plan.counts)
            == counts(second.stats.counts)
            == {
                "cached": 288,
                "replayed_encoder": 16,
                "replayed_decoder": 0,
                "prefilled": 12,
                "mapped": 0,
            }
        )
        assert "288 of them found by content" in second.plan.reason
        assert second.stats.persisted
        # the reader holds its own references on the shared chunks, in the store and in the registry
        store = node.service.store
        assert store.session_chunks("acme", b) == 300 // CHUNK + 1
        with node.service.ctx.sessions() as s:
            mine = {seg.store_key for seg in SegmentRepository(s).for_session(b)}
            theirs = {seg.store_key for seg in SegmentRepository(s).for_session(a)}
        assert len(mine & theirs) >= 288 // CHUNK
    finally:
        node.stop()


def _agent_requests(rng: random.Random) -> list[list[int]]:
    """The tool results of a 4-request agent session (the first is the system prompt and task)."""
    return [_ids(rng, 200), _ids(rng, 40), _ids(rng, 25), _ids(rng, 60)]


def test_stateless_agent_requests_are_full_hits_equal_to_one_session(tmp_path: Path, models) -> None:
    fp = models.get(MODEL).fingerprint_hex
    parts = _agent_requests(random.Random(2))
    # node 1: every request a fresh session carrying the whole conversation (a stateless client)
    stateless = start_node(tmp_path / "stateless", models)
    # node 2: one session continued turn by turn (the uninterrupted computation of ARCHITECTURE §1)
    stateful = start_node(tmp_path / "stateful", models)
    try:
        conversation: list[int] = []
        one = _new_session(stateful)
        for k, part in enumerate(parts):
            prompt = conversation + part
            sid = _new_session(stateless)
            t = run_turn(stateless, sid, prompt, max_new=4)
            ref = run_turn(stateful, one, part, max_new=4)
            if k == 0:
                assert t.path == ref.path == "COLD_PREFILL"
            else:
                assert t.path == "FULL_HIT", t.plan.reason
                assert _reason(stateless, t) == "WINDOWS_BY_CONTENT"
                assert ref.path == "FULL_HIT" and _reason(stateful, ref) == "WINDOWS_IN_POOL"
                assert (
                    counts(t.plan.counts)
                    == counts(t.stats.counts)
                    == {
                        "cached": len(conversation),
                        "replayed_encoder": 0,
                        "replayed_decoder": 0,
                        "prefilled": len(part),
                        "mapped": 0,
                    }
                )
            assert t.tokens == ref.tokens
            conversation = prompt + t.tokens
            # the pooled windows (and the digest of the chunk bytes under them) and the stored chunks
            # are byte for byte the continued session's
            mine = stateless.service.pool.get("acme", sid)
            theirs = stateful.service.pool.get("acme", one)
            assert isinstance(mine, bytes) and mine == theirs
            entry = unpack_pool_entry(mine)
            assert entry is not None and entry.n_tokens == len(conversation)
            stored = _stored_payloads(stateless, "acme", fp, conversation)
            assert stored == _stored_payloads(stateful, "acme", fp, conversation) and stored
    finally:
        stateless.stop()
        stateful.stop()


def test_edited_history_shares_storage_up_to_the_edit(tmp_path: Path, models) -> None:
    rng = random.Random(3)
    node = start_node(tmp_path, models)
    try:
        first = _ids(rng, 150)
        a = _new_session(node)
        t0 = run_turn(node, a, first)
        h0 = first + t0.tokens
        second = _ids(rng, 50)
        b = _new_session(node)
        t1 = run_turn(node, b, h0 + second)
        assert t1.path == "FULL_HIT"
        h1 = h0 + second + t1.tokens

        # edited past the first pooled turn end (inside the second request): windows found by content at
        # that turn end, the rest encoded
        edited = h0 + second[:20] + _ids(rng, 30)
        t = run_turn(node, _new_session(node), edited)
        assert t.path == "FULL_HIT" and t.plan.counts.cached == len(h0), t.plan.reason
        assert _reason(node, t) == "WINDOWS_BY_CONTENT"

        # edited before any pooled turn end: the chunks up to the edit's chunk boundary are shared
        at = 100
        early = h1[:at] + [(h1[at] + 1 - 16) % 4080 + 16] + h1[at + 1 :]
        chunks_before = node.service.store.tenant_stats("acme").chunks
        t = run_turn(node, _new_session(node), early)
        assert t.path == "GLOBAL_REPLAY" and _reason(node, t) == "PREFIX_BY_CONTENT", t.plan.reason
        assert t.plan.counts.cached == at // CHUNK * CHUNK
        # only chunks from the edit's chunk on are new in the store
        n = len(early) + len(t.tokens)
        new_chunks = node.service.store.tenant_stats("acme").chunks - chunks_before
        assert new_chunks == -(-n // CHUNK) - at // CHUNK
    finally:
        node.stop()


def test_purging_the_writer_does_not_strand_the_reader(tmp_path: Path, models) -> None:
    _writer_purge(tmp_path, models, None)


def test_purging_the_writer_does_not_strand_the_reader_postgres(
    tmp_path: Path, models, postgres_url: str
) -> None:
    _writer_purge(tmp_path, models, postgres_url)


def _writer_purge(tmp_path: Path, models, database_url: str | None) -> None:
    rng = random.Random(4)
    node = start_node(tmp_path, models, database_url=database_url)
    pb = node.pb
    try:
        prompt = _ids(rng, 120)
        a = _new_session(node)
        ta = run_turn(node, a, prompt)
        b = _new_session(node)
        tb = run_turn(node, b, prompt + ta.tokens + _ids(rng, 30))
        assert tb.path == "FULL_HIT"
        history_b = prompt + ta.tokens + tb.tokens
        node.admin.Purge(pb.admin.PurgeRequest(session_id=a), metadata=admin_md())
        store = node.service.store
        assert store.session_chunks("acme", a) == 0
        # the reader still holds every chunk of its history (A's included) and its windows: a full hit
        new = _ids(rng, 10)
        t = run_turn(node, b, new)
        assert t.path == "FULL_HIT" and _reason(node, t) == "WINDOWS_IN_POOL", t.plan.reason
        assert t.plan.counts.cached == len(prompt + ta.tokens) + 30 + len(tb.tokens)
        # and the writer's turn end is gone from the pool's index: a third session finds the reader's only
        c = _new_session(node)
        t = run_turn(node, c, prompt + ta.tokens + _ids(rng, 5))
        assert t.path == "GLOBAL_REPLAY" and t.plan.counts.cached == len(prompt + ta.tokens) // CHUNK * CHUNK
        assert len(history_b) > 0
    finally:
        node.stop()


def test_another_tenant_finds_nothing(tmp_path: Path, models) -> None:
    rng = random.Random(5)
    node = start_node(tmp_path, models)
    try:
        prompt = _ids(rng, 100)
        ta = run_turn(node, _new_session(node), prompt)
        other = _new_session(node, tenant="globex")
        t = run_turn(node, other, prompt + ta.tokens + _ids(rng, 10), tenant="globex")
        assert t.path == "COLD_PREFILL" and _reason(node, t) == "NEW_SESSION"
        assert counts(t.stats.counts)["cached"] == 0
        fp = models.get(MODEL).fingerprint_hex
        assert node.service.pool.find_prefix("globex", fp, prompt + ta.tokens + [17]) is None
    finally:
        node.stop()


def test_chunks_no_committed_turn_names_are_not_served(tmp_path: Path, models) -> None:
    # chunks in the store without a registry row (a turn whose transaction never committed) are a miss
    rng = random.Random(6)
    node = start_node(tmp_path, models)
    try:
        fp = models.get(MODEL).fingerprint_hex
        leftover = _ids(rng, 64)
        put = node.service.store.put_chunks(
            "acme", "ghost", fp, leftover, {(0, 32): b"not-a-chunk" * 3, (32, 64): b"x" * 7}
        )
        assert put.refusal is None
        t = run_turn(node, _new_session(node), leftover + _ids(rng, 8))
        assert t.path == "COLD_PREFILL" and counts(t.stats.counts)["cached"] == 0
    finally:
        node.stop()


def test_new_session_on_another_model_follows_the_model_swap_rules(tmp_path: Path) -> None:
    # random-init v41-tiny siblings "a" and "b" (one geometry; W = 32): the conversation was served by "b",
    # a new session asks for "a" with the whole conversation. Without a mapper b -> a nothing of "b" is used;
    # with a validated (identity) mapper registered, b's chunks found by content are mapped.
    models = harness_registry()
    rng = random.Random(7)
    node = start_node(tmp_path, models)
    pb = node.pb
    try:
        sid = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="b"), metadata=md()).session
        prompt = [rng.randrange(16, 512) for _ in range(80)]
        tb = run_turn(node, sid.session_id, prompt)
        conversation = prompt + tb.tokens + [rng.randrange(16, 512) for _ in range(10)]

        def ask_a():
            created = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md())
            return run_turn(node, created.session.session_id, conversation)

        t = ask_a()
        assert t.path == "COLD_PREFILL" and _reason(node, t) == "NEW_SESSION", t.plan.reason
        a, b = models.get("a"), models.get("b")
        mapper = identity_mapper(
            b.model.cfg,
            a.model.cfg,
            sender_name="b",
            receiver_name="a",
            sender_fingerprint=b.fingerprint,
            receiver_fingerprint=a.fingerprint,
        )
        artifact = save_mapper(mapper, tmp_path / "mapper-b-a")
        node.mappers.RegisterMapper(
            pb.mappers.RegisterMapperRequest(
                mapper=pb.mappers.Mapper(
                    mapper_id="id-b-a",
                    sender_model="b",
                    receiver_model="a",
                    artifact_uri=str(artifact),
                    artifact_sha256=read_metadata(artifact)["weights_sha256"],
                    kind="identity",
                    metrics={"copied_parts": 1.0},
                    gate_metric="copied_parts",
                    gate_threshold=1.0,
                    passed_gate=True,
                )
            ),
            metadata=admin_md(),
        )
        # "a" now holds its own chunks of the conversation (the cold turn above): purge them so that only
        # b's remain to be found
        assert node.service.pool.indexed() == 2  # the turn ends of b's session and of a's cold one
        node.admin.Purge(pb.admin.PurgeRequest(model="a"), metadata=admin_md())
        assert node.service.pool.indexed() == 1  # a model purge drops its pooled windows from the index
        t = ask_a()
        assert t.path == "MODEL_SWAP" and _reason(node, t) == "MAPPED_BY_CONTENT", t.plan.reason
        assert (t.plan.source_model, t.plan.mapper_id, t.plan.model) == ("b", "id-b-a", "a")
        n = len(prompt) + len(tb.tokens)
        assert counts(t.plan.counts) == counts(t.stats.counts)
        assert t.plan.counts.mapped == n and t.plan.counts.prefilled == len(conversation) - n
    finally:
        node.stop()


def test_full_hit_needs_the_chunk_bytes_its_windows_were_computed_over(tmp_path: Path, models) -> None:
    # A pool entry whose chunks digest does not match the stored chunk bytes of its history (as when a
    # chunk of the same tokens kept another writer's bytes) is not a full hit, by content or not.
    rng = random.Random(8)
    node = start_node(tmp_path, models)
    try:
        sid = _new_session(node)
        t = run_turn(node, sid, _ids(rng, 90))
        with node.service.ctx.sessions() as s:
            history = SessionRepository(s).history(sid)
        pool = node.service.pool
        entry = unpack_pool_entry(pool.get("acme", sid))
        assert entry is not None and entry.n_tokens == len(history) == 90 + len(t.tokens)
        fp = models.get(MODEL)
        tampered = pack_pool_entry(
            fingerprint=entry.fingerprint, history=history, windows=entry.windows, chunks=bytes(32)
        )
        pool.put("acme", sid, tampered, content=ContentKey.of(fp.fingerprint_hex, history))
        other = run_turn(node, _new_session(node), history + _ids(rng, 5))
        assert other.path == "GLOBAL_REPLAY", other.plan.reason
        own = run_turn(node, sid, _ids(rng, 5))
        assert own.path == "GLOBAL_REPLAY" and _reason(node, own) == "WINDOWS_REBUILT", own.plan.reason
        # the honest entry the turn then pooled is a full hit again
        again = run_turn(node, sid, _ids(rng, 5))
        assert again.path == "FULL_HIT", again.plan.reason
    finally:
        node.stop()


def test_chunks_past_every_holders_retention_are_a_miss(tmp_path: Path, models) -> None:
    _past_retention(tmp_path, models, None)


def test_chunks_past_every_holders_retention_are_a_miss_postgres(
    tmp_path: Path, models, postgres_url: str
) -> None:
    _past_retention(tmp_path, models, postgres_url)


def _past_retention(tmp_path: Path, models, database_url: str | None) -> None:
    """ARCHITECTURE §1: a cache past its retention is a miss. The registry's retention stamps of the
    writer's chunks are moved into the past (as a session whose granted retention ran out); the store
    still holds the bytes (its own ceiling is later), yet neither a new session nor the writer gets them.
    The stamps are compared in SQL, so both dialects run it."""
    import datetime as dt

    from sqlalchemy import update

    from orchestrator.db.models import CacheSegment

    rng = random.Random(11)
    node = start_node(tmp_path, models, database_url=database_url)
    try:
        prompt = _ids(rng, 300)
        a = _new_session(node)
        assert run_turn(node, a, prompt).path == "COLD_PREFILL"
        b = _new_session(node)
        assert _reason(node, run_turn(node, b, prompt)) == "PREFIX_BY_CONTENT"  # live: reused
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        with node.service.ctx.sessions() as s:
            s.execute(update(CacheSegment).values(expires_at=past))
            s.commit()
        again = run_turn(node, a, _ids(rng, 20))  # the writer's own continuation
        assert again.stats.counts.cached == 0, again.plan.reason
        assert "retention" in again.plan.reason, again.plan.reason
        # (that turn stored the chunks anew under A's renewed retention; expire them once more)
        with node.service.ctx.sessions() as s:
            s.execute(update(CacheSegment).values(expires_at=past))
            s.commit()
        late = run_turn(node, _new_session(node), prompt)
        assert late.path == "COLD_PREFILL" and late.stats.counts.cached == 0, late.plan.reason
    finally:
        node.stop()
