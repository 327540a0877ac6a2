"""A catalogue of audit tamperings, each of which the whole audit check must detect (issue 13 items 7-8).

Real parts: a migrated SQLite registry with the SQL audit sink, a real RocksDB store mirroring its
records into it, and the anchor writer with its append-only file and the store's copy. The attacker
may edit both databases and the anchor file, with the node running or (for the store, whose directory
RocksDB locks) stopped; the one thing the attacker lacks is the anchor key, which lives in a file
outside both databases. Narration: tenants acme and globex each get policy changes through the store
(records mirrored into their SQL chains) and admin records in SQL; anchors are written after each
round; then one tampering per case, then verify.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rocksdict import Options, Rdict, WriteBatch
from sqlalchemy import Engine, delete, select, update

from orchestrator.db import AuditChecker, SqlAuditSink, make_engine, upgrade
from orchestrator.db.models import AuditHead, AuditRow
from storage import (
    GENESIS_HASH,
    AnchorFile,
    AnchorKey,
    AuditAction,
    AuditEvent,
    AuditRecord,
    GlobalKVStore,
    RetentionPolicy,
    StoreConfig,
    seal,
    seal_anchor,
)
from storage.audit_rocks import ANCHOR_PREFIX, HEAD_KEY, audit_key

KEY = AnchorKey(hashlib.sha256(b"anchor key of the tamper catalogue").digest())
INTERVAL_S = 60.0
T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@dataclass
class Rig:
    root: Path
    engine: Engine
    sql: SqlAuditSink
    store: GlobalKVStore
    checker: AuditChecker
    clock: Clock
    key: AnchorKey | None

    @property
    def anchor_file(self) -> Path:
        return self.root / "audit-anchors" / "n1.jsonl"

    def open_store(self) -> None:
        self.store = GlobalKVStore(
            StoreConfig(path=str(self.root / "kv")), clock=self.clock, on_audit=self.sql.mirror
        )
        self.checker = AuditChecker(
            self.sql,
            store_audit=self.store.audit,
            store_acked_seq=lambda: self.store.audit_acked_seq,
            anchor_file=AnchorFile(self.anchor_file) if self.key is not None else None,
            key=self.key,
            node="n1",
            interval_s=INTERVAL_S,
            clock=self.clock,
        )
        self.checker.start()

    def stop_store(self) -> None:
        self.checker.stop(final=False)
        self.store.close()

    def restart_with(self, tamper: Callable[[Rdict], None]) -> None:
        """Stop the node, edit the store's database on disk, start again."""
        self.stop_store()
        db = Rdict(str(self.root / "kv" / "db"), options=Options(raw_mode=True))
        try:
            tamper(db)
        finally:
            db.close()
        self.open_store()

    def round(self, n: int) -> None:
        """Store records (policy changes, mirrored into SQL) and SQL-only admin records, then an anchor."""
        for tenant in ("acme", "globex"):
            self.store.set_policy(
                tenant, RetentionPolicy(floor_s=60.0 * n, ceiling_s=86400.0 + n), actor="admin"
            )
            self.sql.append(
                AuditEvent(actor="admin", action=AuditAction.POLICY_CHANGE, tenant=tenant,
                           subject=f"retention:round={n}", reason="admin_request")
            )
        self.checker.anchor()


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One registry migrated to head, copied for each case (migrating takes longer than a case)."""
    path = tmp_path_factory.mktemp("template") / "registry.sqlite3"
    upgrade(f"sqlite:///{path}")
    return path


def _rig(tmp_path: Path, template: Path, *, key: AnchorKey | None = KEY) -> Rig:
    db = tmp_path / "registry.sqlite3"
    shutil.copyfile(template, db)
    engine = make_engine(f"sqlite:///{db}")
    rig = Rig(root=tmp_path, engine=engine, sql=SqlAuditSink(engine), store=None, checker=None,  # type: ignore[arg-type]
              clock=Clock(), key=key)
    rig.open_store()
    for n in range(1, 4):
        rig.round(n)
    return rig


@pytest.fixture
def rig(tmp_path: Path, migrated: Path) -> Iterator[Rig]:
    r = _rig(tmp_path, migrated)
    report = r.checker.verify()
    assert report.verdict == "ok", report.problems
    assert report.anchors == 4 and report.store is not None and report.store.result.records == 6
    yield r
    r.stop_store()
    r.engine.dispose()


def _rows(rig: Rig, chain: str) -> list[AuditRow]:
    with rig.engine.connect() as conn:
        return list(conn.execute(select(AuditRow).where(AuditRow.chain == chain).order_by(AuditRow.seq)))


def _rechain(rig: Rig, chain: str, rows: list[dict]) -> None:
    """Replace `chain` in SQL with `rows` (record fields), re-sealed from genesis, and move its head:
    a forgery with every hash recomputed."""
    prev = GENESIS_HASH
    sealed = []
    for i, r in enumerate(rows, start=1):
        event = AuditEvent(actor=r["actor"], action=AuditAction(r["action"]), tenant=r["tenant"],
                           subject=r["subject"], reason=r["reason"], nbytes=r["nbytes"])
        rec = seal(event, seq=i, ts_us=r["ts_us"], prev_hash=prev)
        sealed.append((rec, r.get("source_hash")))
        prev = rec.hash
    with rig.engine.begin() as conn:
        conn.execute(delete(AuditRow).where(AuditRow.chain == chain))
        for rec, source in sealed:
            conn.execute(AuditRow.__table__.insert().values(
                chain=chain, source_hash=source, **{**rec.__dict__, "action": str(rec.action)}))
        conn.execute(update(AuditHead).where(AuditHead.chain == chain).values(seq=len(sealed), hash=prev))


def _fields(row: AuditRow) -> dict:
    names = ("ts_us", "actor", "action", "tenant", "subject", "reason", "nbytes", "source_hash")
    return {n: getattr(row, n) for n in names}


def _store_records(db: Rdict) -> list[AuditRecord]:
    it = db.iter()
    it.seek(b"A")
    out = []
    while it.valid() and it.key().startswith(b"A"):
        out.append(AuditRecord.from_json(it.value()))
        it.next()
    return out


def _rewrite_store_chain(db: Rdict, records: list[AuditRecord]) -> None:
    """Replace the store's chain by `records`, re-sealed from genesis, with a matching head."""
    batch = WriteBatch(raw_mode=True)
    for rec in _store_records(db):
        batch.delete(audit_key(rec.seq))
    prev = GENESIS_HASH
    for i, r in enumerate(records, start=1):
        event = AuditEvent(actor=r.actor, action=r.action, tenant=r.tenant, subject=r.subject,
                           reason=r.reason, nbytes=r.nbytes)
        rec = seal(event, seq=i, ts_us=r.ts_us, prev_hash=prev)
        batch.put(audit_key(i), rec.to_json())
        prev = rec.hash
    batch.put(HEAD_KEY, len(records).to_bytes(8, "big") + bytes.fromhex(prev))
    db.write(batch)


# Each case: (id, tampering, a phrase the report must contain). All run against the same narration.


def edit_sql_row(rig: Rig) -> None:
    with rig.engine.begin() as conn:
        conn.execute(update(AuditRow).where(AuditRow.chain == "acme", AuditRow.seq == 2).values(nbytes=999))


def edit_store_record(rig: Rig) -> None:
    def tamper(db: Rdict) -> None:
        raw = json.loads(db[audit_key(3)])
        raw["reason"] = raw["reason"].replace("ceiling_s=", "ceiling_s=9")
        db[audit_key(3)] = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()

    rig.restart_with(tamper)


def rechain_store_with_edit(rig: Rig) -> None:
    def tamper(db: Rdict) -> None:
        records = _store_records(db)
        records[1] = AuditRecord(**{**records[1].__dict__, "subject": "policy:forged"})
        _rewrite_store_chain(db, records)

    rig.restart_with(tamper)


def delete_store_records_and_rechain(rig: Rig) -> None:
    rig.restart_with(lambda db: _rewrite_store_chain(db, _store_records(db)[:-2]))


def delete_newest_sql_rows_move_head(rig: Rig) -> None:
    rows = _rows(rig, "globex")
    keep = rows[:-2]
    with rig.engine.begin() as conn:
        conn.execute(delete(AuditRow).where(AuditRow.chain == "globex", AuditRow.seq > keep[-1].seq))
        conn.execute(update(AuditHead).where(AuditHead.chain == "globex")
                     .values(seq=keep[-1].seq, hash=keep[-1].hash))


def wipe_sql_and_reset(rig: Rig) -> None:
    with rig.engine.begin() as conn:
        conn.execute(delete(AuditRow))
        conn.execute(delete(AuditHead))


def wipe_one_tenant_chain(rig: Rig) -> None:
    with rig.engine.begin() as conn:
        conn.execute(delete(AuditRow).where(AuditRow.chain == "acme"))
        conn.execute(delete(AuditHead).where(AuditHead.chain == "acme"))


def rewrite_sql_rows_recompute_chain(rig: Rig) -> None:
    # An SQL-only record (no store record to compare with): only the anchors can tell.
    rows = [_fields(r) for r in _rows(rig, "acme")]
    first_admin = next(i for i, r in enumerate(rows) if r["source_hash"] is None)
    rows[first_admin]["subject"] = "retention:round=0"
    _rechain(rig, "acme", rows)


def drop_sql_mirror_and_rechain(rig: Rig) -> None:
    # A store record's SQL mirror removed, the tenant chain re-sealed so that it verifies on its own.
    rows = [_fields(r) for r in _rows(rig, "globex")]
    first_mirror = next(i for i, r in enumerate(rows) if r["source_hash"] is not None)
    _rechain(rig, "globex", rows[:first_mirror] + rows[first_mirror + 1 :])


def remove_anchor_file_line(rig: Rig) -> None:
    lines = rig.anchor_file.read_bytes().splitlines(keepends=True)
    rig.anchor_file.write_bytes(b"".join(lines[:1] + lines[2:]))


def remove_newest_anchor_file_lines(rig: Rig) -> None:
    lines = rig.anchor_file.read_bytes().splitlines(keepends=True)
    rig.anchor_file.write_bytes(b"".join(lines[:-2]))


def truncate_anchor_file(rig: Rig) -> None:
    rig.anchor_file.write_bytes(b"")


def edit_anchor_line(rig: Rig) -> None:
    lines = rig.anchor_file.read_bytes().splitlines(keepends=True)
    obj = json.loads(lines[-1])
    obj["heads"] = {c: [s - 1, h] for c, (s, h) in obj["heads"].items()}
    lines[-1] = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    rig.anchor_file.write_bytes(b"".join(lines))


def forge_anchor_with_another_key(rig: Rig) -> None:
    # Cut the chain back, then append an anchor that vouches for the cut head, made with a key the
    # attacker does have.
    delete_newest_sql_rows_move_head(rig)
    other = AnchorKey(b"x" * 32)
    file = AnchorFile(rig.anchor_file)
    anchors, _ = file.read()
    forged = seal_anchor(other, node="n1", previous=anchors[-1], ts_us=anchors[-1].ts_us + 1,
                         heads={"globex": rig.sql.chain_head("globex")})
    file.append([forged])
    rig.store.audit.put_anchors([forged])


def remove_store_anchors(rig: Rig) -> None:
    def tamper(db: Rdict) -> None:
        it = db.iter()
        it.seek(ANCHOR_PREFIX)
        keys = []
        while it.valid() and it.key().startswith(ANCHOR_PREFIX):
            keys.append(it.key())
            it.next()
        for k in keys[1:3]:
            del db[k]

    rig.restart_with(tamper)


def wipe_everything_while_running(rig: Rig) -> None:
    # Both chains and both anchor copies gone: only the running writer's own record of having
    # anchored at start is left to contradict it.
    wipe_sql_and_reset(rig)
    truncate_anchor_file(rig)
    store = rig.store.audit
    with store.lock:
        db = rig.store._db
        it = db.iter()
        it.seek(b"")
        keys = []
        while it.valid():
            if it.key()[:1] in (b"A", b"H", ANCHOR_PREFIX):
                keys.append(it.key())
            it.next()
        for k in keys:
            del db[k]


def cut_chain_and_newest_anchors_both_copies(rig: Rig) -> None:
    # The consistent truncation: the newest anchor removed from both copies and the chains cut back to
    # the state the previous anchor saw. Caught by the anchors' age once three intervals have passed.
    anchors, _ = AnchorFile(rig.anchor_file).read()
    previous = anchors[-2]
    lines = rig.anchor_file.read_bytes().splitlines(keepends=True)
    rig.anchor_file.write_bytes(b"".join(lines[:-1]))
    with rig.store.audit.lock:
        del rig.store._db[ANCHOR_PREFIX + anchors[-1].n.to_bytes(8, "big")]
    for chain in ("acme", "globex"):
        seq = max(s for a in anchors[:-1] for c, (s, _) in a.heads.items() if c == chain)
        assert previous is not None
        rows = _rows(rig, chain)
        with rig.engine.begin() as conn:
            conn.execute(delete(AuditRow).where(AuditRow.chain == chain, AuditRow.seq > seq))
            conn.execute(update(AuditHead).where(AuditHead.chain == chain)
                         .values(seq=seq, hash=rows[seq - 1].hash))
    rig.clock.now += 4 * INTERVAL_S


def torn_anchor_garbage(rig: Rig) -> None:
    with open(rig.anchor_file, "ab") as fh:
        fh.write(b'{"n": 99, "mac": "forged"')


CATALOGUE: list[tuple[str, Callable[[Rig], None], str]] = [
    ("edit-sql-row", edit_sql_row, "acme"),
    ("edit-store-record", edit_store_record, "store"),
    ("rechain-store-with-edit", rechain_store_with_edit, "store record"),
    ("delete-store-records-and-rechain", delete_store_records_and_rechain, "does not hold"),
    ("delete-newest-sql-rows-move-head", delete_newest_sql_rows_move_head, "'globex' ends at seq"),
    ("wipe-sql-and-reset", wipe_sql_and_reset, "ends at seq 0"),
    ("wipe-one-tenant-chain", wipe_one_tenant_chain, "'acme' ends at seq 0"),
    ("rewrite-sql-rows-recompute-chain", rewrite_sql_rows_recompute_chain, "(rewritten)"),
    ("drop-sql-mirror-and-rechain", drop_sql_mirror_and_rechain, "missing from the SQL log"),
    ("remove-anchor-file-line", remove_anchor_file_line, "anchors removed"),
    ("remove-newest-anchor-file-lines", remove_newest_anchor_file_lines, "anchor copies disagree"),
    ("truncate-anchor-file", truncate_anchor_file, "anchor copies disagree"),
    ("edit-anchor-line", edit_anchor_line, "bad MAC"),
    ("forge-anchor-with-another-key", forge_anchor_with_another_key, "made with key"),
    ("remove-store-anchors", remove_store_anchors, "store anchors"),
    ("wipe-everything-while-running", wipe_everything_while_running, "no anchors"),
    ("cut-chain-and-newest-anchors-both-copies", cut_chain_and_newest_anchors_both_copies, "s old"),
    ("torn-anchor-garbage", torn_anchor_garbage, "torn last line"),
]


@pytest.mark.parametrize(("tamper", "phrase"), [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE])
def test_every_tampering_is_detected_with_the_key_outside_the_database(
    rig: Rig, tamper: Callable[[Rig], None], phrase: str, chaos_report
) -> None:
    tamper(rig)
    report = rig.checker.verify()
    found = [v.result.reason for v in report.sql if not v.result.ok]
    if report.store is not None and not report.store.result.ok:
        found.append(f"store chain: {report.store.result.reason}")
    found += report.problems
    assert report.verdict == "broken", f"{tamper.__name__} went unnoticed"
    broken_chains = [v.chain for v in report.sql if not v.result.ok]
    assert any(phrase in p for p in found) or phrase in broken_chains, found
    detected = chaos_report.sections.get("audit_tamper", {}).get("detected", [])
    chaos_report.record("audit_tamper", catalogue=len(CATALOGUE),
                        detected=sorted(set(detected) | {tamper.__name__}))


def test_without_a_key_verify_says_unanchored_and_a_reforged_chain_passes(
    tmp_path: Path, migrated: Path
) -> None:
    # Why the key matters: with no anchors, a chain rewritten with every hash recomputed looks genuine.
    rig = _rig(tmp_path, migrated, key=None)
    try:
        assert rig.checker.verify().verdict == "unanchored"
        rewrite_sql_rows_recompute_chain(rig)
        report = rig.checker.verify()
        assert report.verdict == "unanchored" and report.anchors == 0
        edit_sql_row(rig)
        assert rig.checker.verify().verdict == "broken"
    finally:
        rig.stop_store()
        rig.engine.dispose()


def test_a_restart_keeps_the_anchors_and_verify_ok(tmp_path: Path, migrated: Path) -> None:
    rig = _rig(tmp_path, migrated)
    try:
        rig.restart_with(lambda db: None)
        rig.round(4)
        report = rig.checker.verify()
        # 4 anchors before the restart, one at start, one after round 4.
        assert report.verdict == "ok" and report.anchors == 6, report.problems
        # a crash between the file's append and the store's leaves the store one short: repaired at start
        anchors, _ = AnchorFile(rig.anchor_file).read()

        def drop_newest(db: Rdict) -> None:
            del db[ANCHOR_PREFIX + anchors[-1].n.to_bytes(8, "big")]

        rig.restart_with(drop_newest)
        assert rig.checker.verify().verdict == "ok"
    finally:
        rig.stop_store()
        rig.engine.dispose()


def test_audit_local_checks_everything_without_a_server(
    tmp_path: Path, migrated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from orchestrator.cli import main

    rig = _rig(tmp_path, migrated)
    rig.stop_store()
    key_file = tmp_path / "anchor.key"
    key_file.write_bytes(KEY.secret)
    monkeypatch.setenv("KVRESUME_NODE_NAME", "n1")
    args = ["admin", "audit-local", "--data-dir", str(tmp_path),
            "--database-url", f"sqlite:///{tmp_path / 'registry.sqlite3'}"]
    try:
        assert main(args) == 0 and "unanchored" in capsys.readouterr().out
        monkeypatch.setenv("KVRESUME_AUDIT_ANCHOR_KEY_FILE", str(key_file))
        assert main(args) == 0
        out = capsys.readouterr().out
        assert out.startswith("audit ok;") and "anchors checked: 4" in out and "store chain @store/" in out
        rewrite_sql_rows_recompute_chain(rig)
        assert main(args) == 1 and "(rewritten)" in capsys.readouterr().out
    finally:
        rig.engine.dispose()


def test_verify_during_concurrent_appends_is_never_broken(rig: Rig) -> None:
    # A live verify reads the store, then one SQL snapshot: appends racing it are pending or unseen,
    # never a break or a disagreement.
    import threading

    stop = threading.Event()

    def writer() -> None:
        n = 10
        while not stop.is_set():
            n += 1
            rig.round(n)

    th = threading.Thread(target=writer)
    th.start()
    try:
        verdicts = [rig.checker.verify() for _ in range(8)]
    finally:
        stop.set()
        th.join()
    assert [(r.verdict, r.problems) for r in verdicts if r.verdict != "ok"] == []
    assert rig.checker.verify().verdict == "ok"
