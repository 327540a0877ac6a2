"""One session through all four resume paths over real gRPC on loopback, with a real registry database
(SQLite file; the same scenario on PostgreSQL when configured) and a RocksDB store in tmp_path.

Narration (models "a" and "b": seeded random-init v41-tiny, W = 32, ratios 2/1, chunks of 32 tokens):
turn 0 cold prefill of 80 tokens -> turn 1 full hit (equal to the uninterrupted computation) -> the
pool clock passes the TTL -> turn 2 global replay -> turn 3 switch to "b" without a mapper: cold prefill
on "b" -> an identity mapper b -> a is built and registered through the Mappers API, and an admin purges
model "a" -> turn 4 model swap back to "a" -> turn 5 full hit on "a". Every turn's streamed counts equal
its plan's and the formula of its path, and the registry's turn rows hold the same.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mappers import apply_mapper, identity_mapper, read_metadata, save_mapper
from model import prefill
from orchestrator.db import SessionRepository, TurnRepository
from tests.orchestrator.engine.node_harness import (
    POOL_TTL_S,
    WINDOW,
    admin_md,
    continued_greedy,
    counts,
    md,
    registry,
    replay_start,
    run_turn,
    start_node,
    uninterrupted_greedy,
)


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return registry()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 512) for _ in range(n)]


def _scenario(tmp_path: Path, models, database_url: str | None) -> None:
    rng = random.Random(7)
    node = start_node(tmp_path, models, database_url=database_url)
    try:
        pb = node.pb
        created = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md())
        sid = created.session.session_id
        history: list[int] = []

        # turn 0: nothing stored yet
        new = _ids(rng, 80)
        t = run_turn(node, sid, new)
        assert t.path == "COLD_PREFILL" and t.plan.model == "a"
        assert counts(t.plan.counts) == counts(t.stats.counts) == {
            "cached": 0, "replayed_encoder": 0, "replayed_decoder": 0, "prefilled": 80, "mapped": 0,
        }
        assert t.tokens == uninterrupted_greedy(models, "a", new, 3)
        assert t.stats.persisted
        history += new + t.tokens

        # turn 1: stored global KV + pool windows: a full hit, equal to the uninterrupted run
        new = _ids(rng, 20)
        t = run_turn(node, sid, new)
        assert t.path == "FULL_HIT", t.plan.reason
        assert counts(t.plan.counts) == counts(t.stats.counts) == {
            "cached": len(history), "replayed_encoder": 0, "replayed_decoder": WINDOW - 20, "prefilled": 20,
            "mapped": 0,
        }
        # (the session's state kept in memory; a cold prefill of the history equals it only up to
        # floating-point reordering, ARCHITECTURE §1)
        assert t.tokens == continued_greedy(models, "a", [(history[:80], 3), (new, 3)])[1]
        history += new + t.tokens

        # the pool's TTL passes: windows gone, global KV stays -> bounded replay of the last W stored tokens
        node.pool_clock.now += POOL_TTL_S + 1.0
        new = _ids(rng, 40)
        t = run_turn(node, sid, new)
        assert t.path == "GLOBAL_REPLAY", t.plan.reason
        assert "not in the pool" in t.plan.reason
        n = len(history)
        assert counts(t.plan.counts) == counts(t.stats.counts) == {
            "cached": n, "replayed_encoder": n - replay_start(n), "replayed_decoder": 0, "prefilled": 40,
            "mapped": 0,
        }
        history += new + t.tokens

        # switch to the sibling "b" with no mapper registered: an honest cold prefill on the receiver
        new = _ids(rng, 10)
        t = run_turn(node, sid, new, model="b")
        assert t.path == "COLD_PREFILL" and t.plan.model == "b"
        assert t.plan.reason == "no validated mapper for a -> b"
        assert counts(t.plan.counts) == counts(t.stats.counts) == {
            "cached": 0, "replayed_encoder": 0, "replayed_decoder": WINDOW - 10,
            "prefilled": len(history) + 10, "mapped": 0,
        }
        assert t.tokens == uninterrupted_greedy(models, "b", history + new, 3)
        history += new + t.tokens

        # an identity mapper b -> a (same geometry), registered through the Mappers API with the one figure
        # measured here: the fraction of parts it copies code for code (its gate; identity is not fitted)
        a, b = models.get("a"), models.get("b")
        mapper = identity_mapper(
            b.model.cfg, a.model.cfg, sender_name="b", receiver_name="a",
            sender_fingerprint=b.fingerprint, receiver_fingerprint=a.fingerprint,
        )
        with torch.inference_mode():
            probe = prefill(b.model, torch.arange(16, 24).view(1, 8), mode="ced").state
        fps = {"sender_fingerprint": b.fingerprint, "receiver_fingerprint": a.fingerprint}
        applied = apply_mapper(mapper, probe, **fps)
        copied = len(applied.copied_parts) / (2 * len(mapper.layers))
        artifact = save_mapper(mapper, tmp_path / "mapper-b-a")
        node.mappers.RegisterMapper(
            pb.mappers.RegisterMapperRequest(
                mapper=pb.mappers.Mapper(
                    mapper_id="id-b-a", sender_model="b", receiver_model="a", artifact_uri=str(artifact),
                    artifact_sha256=read_metadata(artifact)["weights_sha256"], kind="identity",
                    metrics={"copied_parts": copied}, gate_metric="copied_parts", gate_threshold=1.0,
                    passed_gate=copied >= 1.0,
                )
            ),
            metadata=admin_md(),
        )
        # "a" still holds its own chunks of the older history (a bounded replay would beat mapping), so the
        # admin purges model "a" first: the swap must map from "b".
        node.admin.Purge(pb.admin.PurgeRequest(model="a"), metadata=admin_md())
        new = _ids(rng, 12)
        t = run_turn(node, sid, new, model="a")
        assert t.path == "MODEL_SWAP", t.plan.reason
        assert t.plan.mapper_id == "id-b-a" and t.plan.source_model == "b" and t.plan.model == "a"
        n = len(history)
        assert counts(t.plan.counts) == counts(t.stats.counts) == {
            "cached": 0, "replayed_encoder": n - replay_start(n), "replayed_decoder": WINDOW - 12,
            "prefilled": 12, "mapped": n,
        }
        history += new + t.tokens

        # back on "a" with its own stored chunks (written after the swap) and pool windows
        new = _ids(rng, 5)
        t = run_turn(node, sid, new)
        assert t.path == "FULL_HIT", t.plan.reason
        assert counts(t.stats.counts)["cached"] == len(history)
        history += new + t.tokens

        with node.service.ctx.sessions() as s:
            assert SessionRepository(s).history(sid) == history
            rows = TurnRepository(s).list(sid)
            assert [str(r.path) for r in rows] == [
                "COLD_PREFILL", "FULL_HIT", "GLOBAL_REPLAY", "COLD_PREFILL", "MODEL_SWAP", "FULL_HIT",
            ]
            assert [r.model for r in rows] == ["a", "a", "a", "b", "a", "a"]
            assert all(r.persisted for r in rows)
        lookups = node.service.ctx.metrics.registry
        for result, n in (("hit", 3), ("miss", 2)):
            assert lookups.get_sample_value("kvresume_cache_lookups_total", {"result": result}) == n
        got = node.sessions.GetSession(pb.sessions.GetSessionRequest(session_id=sid), metadata=md())
        assert got.turn_count == 6 and got.history_tokens == len(history) and got.model == "a"
    finally:
        node.stop()


def test_turn_paths_over_grpc_sqlite(tmp_path: Path, models) -> None:
    _scenario(tmp_path, models, None)


def test_turn_paths_over_grpc_postgres(tmp_path: Path, models, postgres_url: str) -> None:
    _scenario(tmp_path, models, postgres_url)


def test_chunked_prefill_turns_equal_one_shot(tmp_path: Path, models) -> None:
    # prompts run in slices of 24 tokens: the cold turn and the full hit give the one-shot tokens, and
    # counts summed over the slices equal the plan's on every path
    rng = random.Random(3)
    node = start_node(tmp_path, models, prefill_chunk_tokens=24)
    try:
        pb = node.pb
        sid = node.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md()).session
        new = _ids(rng, 80)
        t = run_turn(node, sid.session_id, new)
        assert t.path == "COLD_PREFILL" and t.tokens == uninterrupted_greedy(models, "a", new, 3)
        history = new + t.tokens
        new = _ids(rng, 50)
        t = run_turn(node, sid.session_id, new)
        assert t.path == "FULL_HIT" and counts(t.stats.counts) == counts(t.plan.counts)
        assert t.tokens == continued_greedy(models, "a", [(history[:80], 3), (new, 3)])[1]
        node.pool_clock.now += POOL_TTL_S + 1.0
        t = run_turn(node, sid.session_id, _ids(rng, 30))
        assert t.path == "GLOBAL_REPLAY" and counts(t.stats.counts) == counts(t.plan.counts)
    finally:
        node.stop()
