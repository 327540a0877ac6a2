"""The server restarted between turns: the session resumes from disk (registry file + RocksDB store), the
RAM pool is gone so the first turn after the restart is a bounded replay, the next a full hit; a turn the
dead process left RUNNING is removed at start; chunks the registry no longer names (a purge that
committed in SQL) and a chunk whose bytes were damaged on disk are misses, never hits.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from rocksdict import Options, Rdict
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from orchestrator.db import TurnRepository, make_engine
from orchestrator.db.models import CacheSegment, TurnRow, TurnStatus
from storage.chunk_index import CHUNK as CHUNK_PREFIX
from tests.orchestrator.engine.node_harness import counts, md, registry, replay_start, run_turn, start_node


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 512) for _ in range(n)]


def test_session_resumes_from_disk_after_restart(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    first = start_node(tmp_path, registry())
    try:
        pb = first.pb
        sid = first.sessions.CreateSession(
            pb.sessions.CreateSessionRequest(model="a"), metadata=md()
        ).session.session_id
        t0 = run_turn(first, sid, _ids(1, 60))
        t1 = run_turn(first, sid, _ids(2, 10))
        assert (t0.path, t1.path) == ("COLD_PREFILL", "FULL_HIT")
        history = _ids(1, 60) + t0.tokens + _ids(2, 10) + t1.tokens
    finally:
        first.stop()

    # the first process died in the middle of a third turn: its RUNNING row is still in the registry
    engine = make_engine(f"sqlite:///{tmp_path / 'registry.sqlite3'}")
    with Session(engine) as s, s.begin():
        s.add(
            TurnRow(session_id=sid, index=2, model="a", status=TurnStatus.RUNNING, input_tokens=b"\x10\0\0\0")
        )
    engine.dispose()

    second = start_node(tmp_path, registry())
    try:
        assert second.service.reconcile.dangling_rows_deleted == 0
        with second.service.ctx.sessions() as s:
            assert [t.status for t in TurnRepository(s).list(sid)] == [TurnStatus.DONE, TurnStatus.DONE]
        assert second.service.store.recovery.chunks > 0
        t2 = run_turn(second, sid, _ids(3, 8))
        n = len(history)
        assert t2.path == "GLOBAL_REPLAY" and "not in the pool" in t2.plan.reason
        assert (
            counts(t2.stats.counts)
            == counts(t2.plan.counts)
            == {
                "cached": n,
                "replayed_encoder": n - replay_start(n),
                "replayed_decoder": 32 - 8,
                "prefilled": 8,
                "mapped": 0,
            }
        )
        history += _ids(3, 8) + t2.tokens
        t3 = run_turn(second, sid, _ids(4, 6))
        assert t3.path == "FULL_HIT" and t3.stats.counts.cached == len(history)
        history += _ids(4, 6) + t3.tokens
        # the registry forgets the chunks (as a purge committed in SQL does): stored bytes no longer count
        with second.service.ctx.serializable.begin() as s:
            s.execute(delete(CacheSegment))
        t4 = run_turn(second, sid, _ids(5, 4))
        assert t4.path == "COLD_PREFILL" and "not in the registry" in t4.plan.reason
        assert t4.stats.counts.prefilled == len(history) + 4
    finally:
        second.stop()


def test_a_corrupt_chunk_ends_the_prefix(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    first = start_node(tmp_path, registry())
    try:
        pb = first.pb
        created = first.sessions.CreateSession(pb.sessions.CreateSessionRequest(model="a"), metadata=md())
        sid = created.session.session_id
        t0 = run_turn(first, sid, _ids(1, 100))
        history = _ids(1, 100) + t0.tokens
        with first.service.ctx.sessions() as s:
            third = s.scalars(select(CacheSegment.store_key).where(CacheSegment.start_pos == 64)).one()
    finally:
        first.stop()
    # an outside writer flips one payload byte of the chunk holding tokens [64, 96)
    db = Rdict(str(tmp_path / "kv" / "db"), Options(raw_mode=True))
    value = bytearray(db.get(CHUNK_PREFIX + third))
    value[-40] ^= 0x10
    db.put(CHUNK_PREFIX + third, bytes(value))
    db.close()

    second = start_node(tmp_path, registry())
    try:
        t1 = run_turn(second, sid, _ids(2, 5))
        assert t1.path == "GLOBAL_REPLAY", t1.plan.reason
        assert "global KV of 64 of 103" in t1.plan.reason and "failed verification" in t1.plan.reason
        assert (
            counts(t1.stats.counts)
            == counts(t1.plan.counts)
            == {
                "cached": 64,
                "replayed_encoder": 64 - replay_start(64),
                "replayed_decoder": 32 - 5,
                "prefilled": len(history) - 64 + 5,
                "mapped": 0,
            }
        )
        assert second.service.store.stats().misses["corrupt"] == 1
    finally:
        second.stop()
