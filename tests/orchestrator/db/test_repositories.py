"""Repositories on SQLite and PostgreSQL: tenancy, turns, shared segments, fork, purge, reconcile."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy.exc import IntegrityError

from orchestrator.db import (
    DurableSegment,
    PolicyRepository,
    Purger,
    SegmentRepository,
    SessionRepository,
    SqlAuditSink,
    TenantRepository,
    TurnRepository,
    TurnTimings,
    make_engine,
    make_session_factory,
    reconcile_segments,
    run_serializable,
    serializable_factory,
    upgrade,
)
from orchestrator.db.models import TurnStatus
from storage import token_bytes

LATER = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'r.sqlite3'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    upgrade(url)
    eng = make_engine(url)
    yield eng
    eng.dispose()


def _seg(
    key: bytes,
    start: int,
    end: int,
    *,
    tenant: str = "acme",
    model: str = "small",
    node: str = "n1",
    expires: dt.datetime = LATER,
) -> DurableSegment:
    return DurableSegment(
        store_key=key,
        tenant_id=tenant,
        model=model,
        fingerprint=f"fp-{model}",
        start_pos=start,
        end_pos=end,
        nbytes=(end - start) * 890,
        expires_at=expires,
        node=node,
    )


def _session_with_turns(s, tenant: str = "acme", turns=(([1, 2], [3]), ([4], [5, 6]))) -> str:
    TenantRepository(s).ensure(tenant)
    row = SessionRepository(s).create(tenant_id=tenant, model="small", retention_s=60)
    repo = TurnRepository(s)
    for inp, out in turns:
        t = repo.begin(row, model="small", input_tokens=inp)
        repo.finish(t, row, output_tokens=out, timings=TurnTimings(ttft_s=0.1))
    return row.id


def test_tenant_ensure_is_race_safe(engine) -> None:
    # Writers go through the serialisable factory (on SQLite the read factory begins deferred).
    factory = serializable_factory(engine)
    barrier = threading.Barrier(4)
    salts: list[bytes] = []

    def create() -> None:
        barrier.wait()
        salts.append(run_serializable(factory, lambda s: TenantRepository(s).ensure("hooli").salt))

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(salts) == 4 and len(set(salts)) == 1 and len(salts[0]) == 32


def test_turns_extend_history_and_failed_turns_leave_no_trace(engine) -> None:
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        sid = _session_with_turns(s)
        row = SessionRepository(s).get(sid, tenant_id="acme")
        assert (row.turn_count, row.history_tokens) == (2, 6)
        repo = TurnRepository(s)
        failed = repo.begin(row, model="small", input_tokens=[9])
        repo.finish(failed, row, output_tokens=[], timings=TurnTimings(), status=TurnStatus.ABORTED)
        assert SessionRepository(s).history(sid) == [1, 2, 3, 4, 5, 6]
        assert [t.index for t in repo.list(sid)] == [0, 1]
        with pytest.raises(ValueError, match="appends no tokens"):
            repo.begin(row, model="small", input_tokens=[])
    with factory() as s, s.begin():
        row = SessionRepository(s).get(sid, tenant_id="acme")
        TurnRepository(s).begin(row, model="small", input_tokens=[7])
    # A twin turn at the same index (another replica that read the same turn_count) is refused.
    with pytest.raises(IntegrityError), factory() as s, s.begin():
        row = SessionRepository(s).get(sid, tenant_id="acme")
        TurnRepository(s).begin(row, model="small", input_tokens=[8])


def test_sessions_are_tenant_scoped_and_listed_in_order(engine) -> None:
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        for t in ("acme", "globex"):
            TenantRepository(s).ensure(t)
        repo = SessionRepository(s)
        ids = [repo.create(tenant_id="acme", model="small", retention_s=1).id for _ in range(3)]
        other = repo.create(tenant_id="globex", model="small", retention_s=1).id
    with factory() as s:
        repo = SessionRepository(s)
        assert repo.get(other, tenant_id="acme") is None and repo.get(other, tenant_id=None) is not None
        first = repo.list(tenant_id="acme", limit=2)
        rest = repo.list(tenant_id="acme", limit=2, after=(first[-1].created_at, first[-1].id))
        assert [r.id for r in first + rest] == ids and repo.count(tenant_id="acme") == 3
    # The cursor still works after the session it names was deleted.
    with factory() as s, s.begin():
        repo = SessionRepository(s)
        cursor = (first[-1].created_at, first[-1].id)
        repo.delete(repo.get(first[-1].id, tenant_id="acme"))
        assert [r.id for r in repo.list(tenant_id="acme", limit=5, after=cursor)] == ids[2:]


def test_segments_are_shared_and_purged_when_unneeded(engine) -> None:
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        a = _session_with_turns(s)
        segs = SegmentRepository(s)
        segs.link(a, _seg(b"k0", 0, 3))
        segs.link(a, _seg(b"k1", 3, 6))
        fork = SessionRepository(s).fork(SessionRepository(s).get(a, tenant_id="acme"), at_turn=1)
        assert [x.store_key for x in segs.for_session(fork.id)] == [b"k0"]
        assert SessionRepository(s).history(fork.id) == [1, 2, 3]
        # A second session of the tenant storing the same chunk shares the row.
        b = _session_with_turns(s)
        assert segs.link(b, _seg(b"k0", 0, 3)).id == segs.for_session(a)[0].id
        with pytest.raises(ValueError, match="owned by tenant 'acme'"):
            TenantRepository(s).ensure("evil")
            segs.link(b, _seg(b"k0", 0, 3, tenant="evil"))
        assert segs.unlink_session(a) == [b"k1"]
        assert segs.unlink_session(fork.id) == []
        assert segs.unlink_session(b) == [b"k0"]
        assert segs.totals().segments == 0


def test_expired_segments_are_dropped(engine) -> None:
    factory = make_session_factory(engine)
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with factory() as s, s.begin():
        a = _session_with_turns(s)
        segs = SegmentRepository(s)
        segs.link(a, _seg(b"old", 0, 3, expires=now - dt.timedelta(seconds=1)))
        segs.link(a, _seg(b"new", 3, 6, expires=now + dt.timedelta(hours=1)))
        assert segs.expired(now) == [b"old"]
        assert [x.store_key for x in segs.for_session(a)] == [b"new"]


def test_within_retention_compares_each_rows_latest_grant(engine) -> None:
    factory = make_session_factory(engine)
    now = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with factory() as s, s.begin():
        a, b = _session_with_turns(s), _session_with_turns(s)
        segs = SegmentRepository(s)
        segs.link(a, _seg(b"old", 0, 3, expires=now - dt.timedelta(seconds=1)))
        segs.link(a, _seg(b"new", 3, 6, expires=now + dt.timedelta(hours=1)))
        # a second holder with a later grant keeps the shared chunk inside its retention
        segs.link(a, _seg(b"both", 6, 9, expires=now - dt.timedelta(seconds=1)))
        segs.link(b, _seg(b"both", 6, 9, expires=now + dt.timedelta(seconds=5)))
        keys = [b"old", b"new", b"both", b"none"]
        t = now.timestamp()
        assert segs.within_retention(keys, now=t) == {b"old": False, b"new": True, b"both": True}
        assert segs.within_retention(keys, now=t + 7200) == dict.fromkeys(keys[:3], False)
        assert segs.within_retention(keys, now=t, tenant_id="other") == {}
        assert segs.within_retention([], now=t) == {}


def test_policy_ceiling_wins_and_clips_hints(engine) -> None:
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        TenantRepository(s).ensure("acme")
        repo = PolicyRepository(s)
        default = repo.effective("acme", default_floor_s=10, default_ceiling_s=100)
        assert default.is_default and default.clip_retention(None) == 100
        repo.set("acme", floor_s=500, ceiling_s=50, allowed_regions=["eu-1"])
        eff = repo.effective("acme", default_floor_s=10, default_ceiling_s=100)
        assert (eff.floor_s, eff.ceiling_s) == (50, 50)
        assert eff.clip_retention(1) == 50 and eff.may_store_in("eu-1") and not eff.may_store_in("us-1")


def test_purger_tenant_rotates_salt_and_audits(engine) -> None:
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        a = _session_with_turns(s)
        SegmentRepository(s).link(a, _seg(b"k0", 0, 3))
        old_salt = TenantRepository(s).get("acme").salt

    class FakeStore:
        """Records what the purger asks of the store (the real store is storage's GlobalKVStore)."""

        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def purge_tenant(self, tenant, *, actor, reason="request"):
            self.calls.append(("tenant", tenant, actor))
            return type("R", (), {"chunks_deleted": 1, "bytes_deleted": 2670})()

    store = FakeStore()
    sink = SqlAuditSink(engine)
    out = Purger(serializable_factory(engine), sink, store).purge_tenant("acme", actor="admin", reason="gdpr")
    assert (out.sessions_deleted, out.segments_deleted, out.bytes_deleted) == (1, 1, 2670)
    assert store.calls == [("tenant", "acme", "admin")]
    with factory() as s:
        assert TenantRepository(s).get("acme").salt != old_salt
        assert SessionRepository(s).count(tenant_id="acme") == 0
    (rec,) = sink.query(action="purge")
    assert (rec.subject, rec.reason, rec.nbytes) == ("tenant:acme", "gdpr", 2670)


def test_reconcile_drops_rows_without_durable_chunks(engine) -> None:
    factory = make_session_factory(engine)
    with factory() as s, s.begin():
        a = _session_with_turns(s)
        segs = SegmentRepository(s)
        segs.link(a, _seg(b"durable", 0, 3))
        segs.link(a, _seg(b"lost-in-crash", 3, 6))
        segs.link(a, _seg(b"other-node", 6, 7, node="n2"))
    durable = {b"durable", b"written-but-row-missing"}
    report = reconcile_segments(
        serializable_factory(engine),
        node="n1",
        store_has=lambda keys: set(keys) & durable,
        store_keys=durable,
    )
    assert (report.rows_checked, report.dangling_rows_deleted) == (2, 1)
    assert report.unreferenced_chunks == frozenset({b"written-but-row-missing"})
    with factory() as s:
        assert [x.store_key for x in SegmentRepository(s).for_session(a)] == [b"durable", b"other-node"]


def test_per_turn_core_reads_equal_their_orm_twins_and_see_pending_changes(engine) -> None:
    """facts, history, spans_of and effective run on the Session's connection (`read_connection`); their
    slow twins are the same statements through `Session.execute` (the ORM path, with its autoflush)."""
    import random
    import secrets

    from orchestrator.db.repositories import policies, segments, sessions

    rng = random.Random(secrets.randbits(64))
    factory = make_session_factory(engine)
    turns = tuple(
        ([rng.randrange(0, 1 << 20) for _ in range(rng.randrange(1, 9))], [rng.randrange(0, 99)])
        for _ in range(rng.randrange(1, 6))
    )
    with factory() as s, s.begin():
        sid = _session_with_turns(s, turns=turns)
        cut = rng.randrange(1, 2000)
        SegmentRepository(s).link_current(
            sid, "fp-small", [_seg(b"k1" * 16, 0, cut), _seg(b"k2" * 16, cut, 4000)]
        )
        if rng.random() < 0.5:
            PolicyRepository(s).set(
                "acme", floor_s=5.0, ceiling_s=rng.uniform(10, 1e5), allowed_regions=["eu"]
            )
        row = SessionRepository(s).get(sid, tenant_id="acme")
        # a pending ORM change: Session.execute would autoflush it before the read, and so must these
        row.turn_count += 7
        repo = SessionRepository(s)
        fast = repo.facts(sid, tenant_id="acme")
        slow = s.execute(sessions._FACTS, {"sid": sid}).one()
        assert tuple(fast) == tuple(slow) and fast.turn_count == len(turns) + 7
        blob = b"".join(b for r in s.execute(sessions._HISTORY, {"sid": sid}) for b in r)
        assert repo.history(sid) == sessions.blob_to_tokens(blob) == [t for i, o in turns for t in i + o]
        assert [tuple(r) for r in SegmentRepository(s).spans_of(sid)] == [
            tuple(r) for r in s.execute(segments._SPANS, {"sid": sid}).all()
        ]
        eff = PolicyRepository(s).effective("acme", default_floor_s=1.0, default_ceiling_s=2.0)
        ref = s.execute(policies._EFFECTIVE, {"tid": "acme"}).one_or_none()
        if ref is None:
            assert eff.is_default and (eff.floor_s, eff.ceiling_s) == (1.0, 2.0)
        else:
            assert (eff.floor_s, eff.ceiling_s, eff.allowed_regions, eff.is_default) == (
                min(ref.retention_floor_s, ref.retention_ceiling_s),
                ref.retention_ceiling_s,
                tuple(ref.allowed_regions),
                False,
            )


def test_retained_keys_equal_within_retention_on_random_rows(engine) -> None:
    """RetainedKeys (on SQLite one driver read) against its twin, SegmentRepository.within_retention
    through a Session: random rows of two tenants and fingerprints, random expiries, keys absent too."""
    import random
    import secrets

    from orchestrator.db import RetainedKeys

    rng = random.Random(secrets.randbits(64))
    factory = make_session_factory(engine)
    base = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    keys = [secrets.token_bytes(32) for _ in range(40)]
    with factory() as s, s.begin():
        for tenant in ("acme", "hooli"):
            TenantRepository(s).ensure(tenant)
            sid = SessionRepository(s).create(tenant_id=tenant, model="small", retention_s=60).id
            segs = [
                _seg(
                    key,
                    i * 8,
                    i * 8 + 8,
                    tenant=tenant,
                    model=rng.choice(["small", "big"]),
                    expires=base
                    + dt.timedelta(seconds=rng.randrange(-5000, 5000), microseconds=rng.randrange(10**6)),
                )
                for i, key in enumerate(keys)
                if (tenant == "acme") == (i % 3 != 0)
            ]
            SegmentRepository(s).link_current(sid, "fp-small", [g for g in segs if g.model == "small"])
            SegmentRepository(s).link_current(sid, "fp-big", [g for g in segs if g.model == "big"])
    fast, slow = RetainedKeys(factory), RetainedKeys(factory, driver=False)
    seen: set[bool] = set()
    for _ in range(30):
        asked = rng.sample(keys, rng.randrange(0, len(keys))) + [secrets.token_bytes(32)]
        now = (base + dt.timedelta(seconds=rng.randrange(-6000, 6000))).timestamp() + rng.random()
        for tenant in ("acme", "hooli", "nobody"):
            for fp in ("fp-small", "fp-big"):
                got = fast(asked, now=now, tenant_id=tenant, fingerprint=fp)
                with factory() as s:
                    ref = SegmentRepository(s).within_retention(
                        asked, now=now, tenant_id=tenant, fingerprint=fp
                    )
                assert got == ref == slow(asked, now=now, tenant_id=tenant, fingerprint=fp)
                seen |= set(got.values())
    assert seen == {True, False}
    assert fast([], now=0.0, tenant_id="acme", fingerprint="fp-small") == {}


def test_turn_reads_equal_the_repositories_in_a_session_on_random_sessions(engine) -> None:
    """TurnReads (on SQLite one driver transaction) against its twins, the repositories' facts, history,
    effective and spans_of in one Session: random sessions, turns, segments and policies, closed and
    failed turns, another tenant's session and an unknown one."""
    import random
    import secrets

    from sqlalchemy import select

    from orchestrator.db import MapperRegistration, MapperRepository, TurnReads, session_view
    from orchestrator.db.models import MapperRow, SessionRow, SessionStatus
    from orchestrator.db.repositories.driver_select import DriverSelect

    rng = random.Random(secrets.randbits(64))
    factory = make_session_factory(engine)
    ids: list[tuple[str, str]] = []
    with factory() as s, s.begin():
        for tenant in ("acme", "hooli"):
            if rng.random() < 0.6:
                TenantRepository(s).ensure(tenant)
                floor = rng.uniform(0, 100)
                regions = rng.sample(["eu", "us", "é"], rng.randrange(0, 3))
                PolicyRepository(s).set(
                    tenant, floor_s=floor, ceiling_s=rng.uniform(1, 1e5), allowed_regions=regions
                )
            for _ in range(3):
                turns = tuple(
                    ([rng.randrange(0, 1 << 30) for _ in range(rng.randrange(1, 9))], [rng.randrange(0, 99)])
                    for _ in range(rng.randrange(0 if ids else 1, 5))
                )
                sid = _session_with_turns(s, tenant=tenant, turns=turns)
                row = SessionRepository(s).get(sid, tenant_id=tenant)
                TurnRepository(s).finish(
                    TurnRepository(s).begin(row, model="small", input_tokens=[1]),
                    row,
                    output_tokens=[],
                    timings=TurnTimings(),
                    status=TurnStatus.FAILED,
                )
                if rng.random() < 0.3:
                    row.status = SessionStatus.CLOSED
                cut = rng.randrange(1, 100)
                SegmentRepository(s).link_current(
                    sid,
                    "fp-small",
                    [
                        _seg(secrets.token_bytes(32), 0, cut, tenant=tenant),
                        _seg(secrets.token_bytes(32), cut, 200, tenant=tenant),
                    ],
                )
                ids.append((sid, tenant))
        models = ("small", "big", "tiny")
        for i in range(rng.randrange(0, 7)):
            sender, receiver = rng.sample(models, 2)
            passed = rng.random() < 0.5
            metrics = {"retention": rng.random(), "cos": rng.random()} if rng.random() < 0.7 else {}
            MapperRepository(s).register(
                MapperRegistration(
                    mapper_id=f"m{i}-{rng.randrange(100)}",
                    sender_model=sender,
                    receiver_model=receiver,
                    artifact_uri=f"file:///m{i}",
                    artifact_sha256=secrets.token_hex(32) if rng.random() < 0.5 else "",
                    kind=rng.choice(["ridge", "mlp"]),
                    metrics={**metrics, "cos": 0.9} if passed else metrics,
                    gate_metric="cos" if passed else "",
                    gate_threshold=0.5 if passed else None,
                    passed_gate=passed,
                )
            )
    fast = TurnReads(factory)
    asked = ids + [(sid, "hooli" if t == "acme" else "acme") for sid, t in ids] + [("nobody", "acme")]
    for sid, tenant in asked:
        defaults = dict(default_floor_s=rng.uniform(0, 5), default_ceiling_s=rng.uniform(10, 50))
        model = rng.choice([None, "small", "big", "tiny"])
        got = fast.read(sid, tenant_id=tenant, model=model, **defaults)
        with factory() as s:
            row = SessionRepository(s).facts(sid, tenant_id=tenant)
            # the blob a turn on PostgreSQL reads (its ids as the store takes them, not encoded again)
            blob = SessionRepository(s).history_blob(sid)
            assert blob == token_bytes(SessionRepository(s).history(sid))
            if engine.dialect.name != "sqlite":
                assert got is None
                continue
            if row is None:
                assert got.row is None and got.history == [] and got.spans == [] and got.policy is None
                continue
            assert tuple(got.row) == tuple(row) and got.row._fields == tuple(row._fields)
            assert type(got.row.status) is type(row.status)
            assert got.history == SessionRepository(s).history(sid) and len(got.history) == row.history_tokens
            # the ids as read are the ids the store takes (u32 little-endian), as encoding the history gives
            assert got.history_ids == token_bytes(got.history)
            assert got.policy == PolicyRepository(s).effective(row.tenant_id, **defaults)
            assert [tuple(r) for r in got.spans] == [tuple(r) for r in SegmentRepository(s).spans_of(sid)]
            name = model or row.model
            # the twin of reads_mappers: _registered's rule, spelled through session_view's last_model
            last = session_view(row, new_tokens=1).last_model
            if (last is not None and last != name) or not got.history:
                cols = [c.key for c in MapperRow.__table__.columns]
                want = [
                    tuple(getattr(m, c) for c in cols) for m in MapperRepository(s).list(receiver_model=name)
                ]
                assert [tuple(r) for r in got.mappers] == want and all(
                    r._fields == tuple(cols) for r in got.mappers
                )
            else:
                assert got.mappers is None
    # The one-statement read against its twin, the four statements in a transaction (also its fallback,
    # taken here once more for an aggregate that reads as out of turn order), on every session as the
    # session's own model reads it (the case it serves: no mapper rows) and as the other tenant reads it.
    if engine.dialect.name == "sqlite":
        from unittest import mock

        import orchestrator.db.repositories.turn_reads as turn_reads

        four_statements = TurnReads(factory, one_statement=False)
        served = 0
        for sid, tenant in asked:
            defaults = dict(default_floor_s=rng.uniform(0, 5), default_ceiling_s=rng.uniform(10, 50))
            with mock.patch.object(
                TurnReads, "_read_in_transaction", autospec=True, side_effect=TurnReads._read_in_transaction
            ) as fallback:
                got = fast.read(sid, tenant_id=tenant, **defaults)
            served += got.row is not None and not fallback.called
            want = four_statements.read(sid, tenant_id=tenant, **defaults)
            assert got == want
            assert got.row is None or [r._fields for r in got.spans] == [r._fields for r in want.spans]
            with mock.patch.object(turn_reads, "_increasing", return_value=False):
                assert fast.read(sid, tenant_id=tenant, **defaults) == want
        # sessions with history were asked (the first has at least one turn)
        assert served > 0
    assert TurnReads(factory, driver=False).read("x", tenant_id="acme", **defaults) is None
    with pytest.raises(ValueError, match="expanding"):
        DriverSelect(select(SessionRow.id).where(SessionRow.id.in_(["a"])), engine.dialect)
