"""Audit chain format: seal / verify_chain, and RocksAuditSink against tampering in the database."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rocksdict import Options, Rdict

from storage import (
    GENESIS_HASH,
    AuditAction,
    AuditEvent,
    AuditRecord,
    RocksAuditSink,
    chain_hash,
    seal,
    verify_chain,
)
from storage.audit_rocks import HEAD_KEY, audit_key


def _event(i: int) -> AuditEvent:
    return AuditEvent(
        actor="storage", action=AuditAction.STORE, tenant="t-é", subject=f"chunk:{i}", reason="put", nbytes=i
    )


def _chain(n: int) -> list[AuditRecord]:
    out: list[AuditRecord] = []
    prev = GENESIS_HASH
    for i in range(1, n + 1):
        rec = seal(_event(i), seq=i, ts_us=1_000 * i, prev_hash=prev)
        out.append(rec)
        prev = rec.hash
    return out


def test_seal_hash_is_sha256_of_prev_and_canonical_body() -> None:
    rec = seal(_event(1), seq=1, ts_us=5, prev_hash=GENESIS_HASH)
    body = rec.canonical_body()
    # Sorted keys, compact, utf-8, hash excluded, action as its string value.
    assert json.loads(body) == {
        "seq": 1,
        "ts_us": 5,
        "actor": "storage",
        "action": "store",
        "tenant": "t-é",
        "subject": "chunk:1",
        "reason": "put",
        "nbytes": 1,
        "prev_hash": GENESIS_HASH,
    }
    assert list(json.loads(body)) == sorted(json.loads(body))
    assert "é".encode() in body
    assert rec.hash == chain_hash(GENESIS_HASH, body)
    assert AuditRecord.from_json(rec.to_json()) == rec


def test_verify_chain_ok_and_each_tampering_detected() -> None:
    recs = _chain(6)
    assert verify_chain(recs, head=(6, recs[-1].hash)).ok
    edited = recs.copy()
    edited[2] = dataclasses.replace(recs[2], nbytes=999)
    res = verify_chain(edited)
    assert (res.ok, res.first_break_seq, res.reason) == (False, 3, "hash mismatch")
    reordered = [recs[0], recs[2], recs[1], *recs[3:]]
    assert verify_chain(reordered).first_break_seq == 2
    deleted = [recs[0], recs[1], *recs[3:]]
    assert verify_chain(deleted).first_break_seq == 3
    # Deleting the newest record leaves a valid prefix; only the head catches it.
    assert verify_chain(recs[:-1]).ok
    res = verify_chain(recs[:-1], head=(6, recs[-1].hash))
    assert not res.ok and res.first_break_seq == 6
    # Re-sealing an edited record with a fresh hash still breaks its successor's link.
    forged = seal(dataclasses.replace(_event(3), nbytes=7), seq=3, ts_us=3000, prev_hash=recs[1].hash)
    res = verify_chain([recs[0], recs[1], forged, *recs[3:]])
    assert (res.first_break_seq, res.reason) == (4, "prev_hash mismatch")


def test_audit_event_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        AuditEvent(actor="a", action=AuditAction.PURGE, tenant="", subject="", reason="", nbytes=-1)
    with pytest.raises(ValueError):
        AuditEvent(actor="a", action="no_such_action", tenant="", subject="", reason="")


def test_rocks_audit_sink_append_reopen_verify_and_tamper(tmp_path) -> None:
    opts = Options(raw_mode=True)
    db = Rdict(str(tmp_path / "db"), opts)
    sink = RocksAuditSink(db, clock=lambda: 12.5)
    for i in range(1, 6):
        rec = sink.append(_event(i))
        assert rec.seq == i and rec.ts_us == 12_500_000
    db.close()
    db = Rdict(str(tmp_path / "db"), opts)
    sink = RocksAuditSink(db)
    assert sink.head()[0] == 5 and sink.verify().ok
    assert [r.seq for r in sink.iter_records()] == [1, 2, 3, 4, 5]
    # Edit a record's bytes directly in the database.
    raw = db.get(audit_key(2))
    db.put(audit_key(2), raw.replace(b'"nbytes":2', b'"nbytes":3'))
    res = sink.verify()
    assert (res.ok, res.first_break_seq) == (False, 2)
    db.put(audit_key(2), raw)
    assert sink.verify().ok
    # Garbage bytes are a break at that seq, not an exception.
    db.put(audit_key(4), b"\x00not json")
    assert sink.verify().first_break_seq == 4
    db.put(audit_key(4), b"")
    db.delete(audit_key(4))
    assert sink.verify().first_break_seq == 4
    db.close()


def test_rocks_audit_sink_detects_truncated_tail(tmp_path) -> None:
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    sink = RocksAuditSink(db)
    for i in range(1, 4):
        sink.append(_event(i))
    db.delete(audit_key(3))
    res = sink.verify()
    assert not res.ok and res.first_break_seq == 3
    assert db.get(HEAD_KEY) is not None
    db.close()


def _seal_reference(event: AuditEvent, *, seq: int, ts_us: int, prev_hash: str) -> AuditRecord:
    """The slow twin of `seal`: an unsealed record from the event's `dataclasses.asdict` and the chain
    fields, its body from `dataclasses.fields`, then the hash."""
    unsealed = AuditRecord(**dataclasses.asdict(event), seq=seq, ts_us=ts_us, prev_hash=prev_hash, hash="")
    body = {f.name: getattr(unsealed, f.name) for f in dataclasses.fields(unsealed) if f.name != "hash"}
    body["action"] = str(unsealed.action)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return dataclasses.replace(unsealed, hash=chain_hash(prev_hash, canonical))


def _to_json_reference(rec: AuditRecord) -> bytes:
    out = dataclasses.asdict(rec)
    out["action"] = str(rec.action)
    return json.dumps(out, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def test_seal_and_to_json_equal_their_reference_twins_on_random_records() -> None:
    import random
    import secrets

    rng = random.Random(secrets.randbits(64))
    alphabet = "abcXYZ09 _-:é\"\\\n\u2603"
    prev = GENESIS_HASH
    for seq in range(1, 300):
        event = AuditEvent(
            actor=rng.choice(["storage", "maintenance", "admin:é"]),
            action=rng.choice(list(AuditAction)),
            tenant="".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))),
            subject="chunk:" + secrets.token_hex(rng.randrange(1, 33)),
            reason="".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 20))),
            nbytes=rng.randrange(0, 1 << rng.choice([1, 20, 40, 62])),
        )
        ts_us = rng.randrange(0, 1 << 52)
        fast = seal(event, seq=seq, ts_us=ts_us, prev_hash=prev)
        slow = _seal_reference(event, seq=seq, ts_us=ts_us, prev_hash=prev)
        assert fast == slow, f"seal differs from its reference at seq {seq}: {fast} != {slow}"
        assert fast.to_json() == _to_json_reference(fast)
        assert AuditRecord.from_json(fast.to_json()) == fast
        assert chain_hash(prev, fast.canonical_body()) == fast.hash
        prev = fast.hash if rng.random() < 0.7 else secrets.token_hex(32)
