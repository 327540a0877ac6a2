"""link_current (an upsert, links added ON CONFLICT DO NOTHING, stale links deleted RETURNING; on SQLite as
driver statements, whose twin is the same in Core, `link_current_core`) leaves the rows its reference twin
leaves (`link_current_reference`: read, then insert / extend / link / unlink /
delete what differs), and returns the same deleted keys, on fresh random call sequences: sessions sharing
chunks, expiries moving up and down, superseded tails, a second fingerprint, empty segment lists, keys
given twice; SQLite and PostgreSQL; both also from the session's links (`link_sqlite.INCREMENTAL_FROM`, which
`link_current_core` follows too).
A key of another tenant is refused alike."""

from __future__ import annotations

import datetime as dt
import random

import pytest
from sqlalchemy import select

from orchestrator.db import (
    DurableSegment,
    SegmentRepository,
    SessionRepository,
    TenantRepository,
    make_engine,
    run_serializable,
    serializable_factory,
    upgrade,
)
from orchestrator.db.models import CacheSegment, SessionSegment
from orchestrator.db.repositories import link_sqlite

_CS, _SS = CacheSegment.__table__, SessionSegment.__table__
BASE = dt.datetime(2100, 1, 1, tzinfo=dt.UTC)


def _calls(seed: int) -> list[tuple[int, str, list[DurableSegment]]]:
    """(session index, fingerprint, segments) of each call: chains of chunks of 64 tokens per session,
    whose tail is superseded now and then; prefixes shared between sessions; random expiries."""
    rng = random.Random(seed)
    calls = []
    lengths = [rng.randint(1, 4) for _ in range(3)]
    for _ in range(rng.randint(4, 10)):
        i = rng.randrange(3)
        fp = "fp" if rng.random() < 0.8 else "fp2"
        lengths[i] += rng.randint(0, 2)
        n = lengths[i]
        expires = BASE + dt.timedelta(seconds=rng.randint(-5, 5))
        # full chunks shared by every session (one key per position), a tail of this session's own
        segs = [
            DurableSegment(
                store_key=bytes([1, k, fp == "fp2"]),
                tenant_id="acme",
                model="small",
                fingerprint=fp,
                start_pos=64 * k,
                end_pos=64 * (k + 1),
                nbytes=890 * 64,
                expires_at=expires,
                node="n1",
                region="r",
                numerics="portable",
            )
            for k in range(n - 1)
        ]
        if rng.random() < 0.85:
            tail = rng.randint(1, 63)
            segs.append(
                DurableSegment(
                    store_key=bytes([2, i, n, tail, fp == "fp2"]),
                    tenant_id="acme",
                    model="small",
                    fingerprint=fp,
                    start_pos=64 * (n - 1),
                    end_pos=64 * (n - 1) + tail,
                    nbytes=890 * tail,
                    expires_at=expires,
                    node="n1",
                )
            )
        if segs and rng.random() < 0.1:
            segs.append(segs[0])  # a key given twice
        if rng.random() < 0.1:
            segs = []
        rng.shuffle(segs) if rng.random() < 0.2 else None
        calls.append((i, fp, segs))
    return calls


def _run(url: str, seed: int, *, how: str) -> tuple[list[list[bytes]], list[tuple], list[tuple], list[tuple]]:
    engine = make_engine(url)
    factory = serializable_factory(engine)
    try:

        def setup(s):
            TenantRepository(s).ensure("acme")
            return [
                SessionRepository(s).create(tenant_id="acme", model="small", retention_s=60).id for _ in "abc"
            ]

        sids = run_serializable(factory, setup)
        returned = []
        for i, fp, segs in _calls(seed):

            def work(s, i=i, fp=fp, segs=segs):
                call = getattr(SegmentRepository(s), how)
                if how == "link_current_core" and len({g.store_key for g in segs}) != len(segs):
                    call = SegmentRepository(s).link_current_reference  # the Core path takes distinct keys
                return call(sids[i], fp, segs)

            returned.append(sorted(run_serializable(factory, work)))
        with engine.connect() as conn:
            cols = [c for c in _CS.c if c.name not in ("id", "stored_at")]
            rows = sorted(tuple(r) for r in conn.execute(select(*cols)))
            links = sorted(
                (sids.index(r.session_id), r.store_key)
                for r in conn.execute(select(_SS.c.session_id, _CS.c.store_key).join(_CS))
            )
            # as stored (no type processing): the expiry stamps' text on SQLite
            stored = sorted(
                tuple(r) for r in conn.exec_driver_sql("select store_key, expires_at from cache_segments")
            )
        return returned, rows, links, stored
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request, tmp_path):
    """A factory of fresh migrated registries of the parametrized backend."""
    if request.param == "sqlite":
        names = iter(range(100))
        template = tmp_path / "template.sqlite3"
        upgrade(f"sqlite:///{template}")

        def sqlite_copy() -> str:
            target = tmp_path / f"r{next(names)}.sqlite3"
            target.write_bytes(template.read_bytes())
            return f"sqlite:///{target}"

        return sqlite_copy
    base = request.getfixturevalue("postgres_url")
    engine = make_engine(base)
    engine.dispose()

    def pg_schema() -> str:
        # one schema per test (the fixture's); each run starts from empty tables
        upgrade(base)
        with make_engine(base).begin() as conn:
            for table in ("session_segments", "cache_segments", "sessions", "tenants"):
                conn.exec_driver_sql(f"delete from {table}")
        return base

    return pg_schema


@pytest.mark.parametrize("incremental_from", [0, link_sqlite.INCREMENTAL_FROM, 10**6])
@pytest.mark.parametrize("seed", range(8))
def test_link_current_leaves_the_reference_rows(fresh_url, seed, incremental_from, monkeypatch) -> None:
    # from the session's links at every size (0), from the default size, never: SQLite's driver statements
    # and the Core path alike
    monkeypatch.setattr(link_sqlite, "INCREMENTAL_FROM", incremental_from)
    fast = _run(fresh_url(), seed, how="link_current")
    twin = _run(fresh_url(), seed, how="link_current_reference")
    assert fast == twin
    assert fast[1], "the scenario recorded no chunk"
    assert _run(fresh_url(), seed, how="link_current_core") == twin


@pytest.mark.parametrize("how", ["link_current", "link_current_core", "link_current_reference"])
def test_a_key_of_another_tenant_is_refused_alike(registry_copy, how) -> None:
    engine = make_engine(registry_copy("r"))
    factory = serializable_factory(engine)
    try:

        def setup(s):
            TenantRepository(s).ensure("acme")
            TenantRepository(s).ensure("other")
            return [
                SessionRepository(s).create(tenant_id=t, model="small", retention_s=60).id
                for t in ("acme", "other")
            ]

        a, b = run_serializable(factory, setup)
        seg = DurableSegment(
            store_key=b"k", tenant_id="acme", model="small", fingerprint="fp", start_pos=0, end_pos=64,
            nbytes=1, expires_at=BASE,
        )  # fmt: skip
        theirs = DurableSegment(
            store_key=b"k", tenant_id="other", model="small", fingerprint="fp", start_pos=0, end_pos=64,
            nbytes=1, expires_at=BASE + dt.timedelta(days=1),
        )  # fmt: skip
        run_serializable(factory, lambda s: SegmentRepository(s).link_current(a, "fp", [seg]))

        def work(s):
            getattr(SegmentRepository(s), how)(b, "fp", [theirs])

        with pytest.raises(ValueError, match="store key already owned by tenant 'acme', not 'other'"):
            run_serializable(factory, work)
        with engine.connect() as conn:
            assert [tuple(r) for r in conn.execute(select(_CS.c.tenant_id, _CS.c.expires_at))] == [
                ("acme", BASE)
            ]
            assert conn.execute(select(_SS.c.session_id)).scalars().all() == [a]
    finally:
        engine.dispose()
