"""DriverDML and DriverSelect against their slow twins, the same Core statements through
`Connection.execute`: the per-turn writes (session move, turn insert, audit head move, audit log insert)
run on two copies of one registry with the same random values, then both databases are read whole."""

from __future__ import annotations

import datetime as dt
import random
import secrets

import pytest
from sqlalchemy import select, text

from orchestrator.db import DriverDML, make_engine, run_serializable, serializable_factory
from orchestrator.db.audit_sink import _HEAD, _HEAD_MOVE_IF, _LOG, _LOG_ADD, _ROW_KEYS
from orchestrator.db.models import SessionRow, SessionStatus, TurnRow, TurnStatus
from orchestrator.db.repositories.driver_select import DriverSelect
from orchestrator.registry_writer.finish import _FINISH


def _fill(conn, rng: random.Random) -> list[str]:
    conn.execute(text("INSERT INTO tenants (id, salt, created_at) VALUES ('acme', x'00', '2030-01-01')"))
    sids = []
    for i in range(4):
        sid = f"s{i}"
        conn.execute(
            SessionRow.__table__.insert(),
            dict(
                id=sid,
                tenant_id="acme",
                model="m",
                # one open session at least, so that some guarded moves can match
                status=SessionStatus.OPEN if i == 0 else rng.choice(list(SessionStatus)),
                retention_s=60.0,
                node="n",
                region="r",
                history_tokens=rng.randrange(9),
                turn_count=rng.randrange(3),
            ),
        )
        sids.append(sid)
    conn.execute(
        _HEAD.insert(),
        [{"chain": "zz1", "seq": 3, "hash": "a" * 64}, {"chain": "zz2", "seq": 1, "hash": "b" * 64}],
    )
    return sids


def _dump(conn) -> dict[str, list[tuple]]:
    out = {}
    for table in (SessionRow.__table__, TurnRow.__table__, _HEAD, _LOG):
        rows = conn.execute(select(table).order_by(*table.primary_key.columns)).all()
        # the stamps SQLAlchemy computes at execution (updated_at, created_at): same type, taken apart
        out[table.name] = [tuple(type(v) if isinstance(v, dt.datetime) else v for v in row) for row in rows]
    return out


def test_driver_dml_writes_what_core_writes_on_random_values(registry_copy) -> None:
    rng = random.Random(secrets.randbits(64))
    core_eng, drv_eng = make_engine(registry_copy("core")), make_engine(registry_copy("driver"))
    seed = rng.randrange(1 << 30)
    for eng in (core_eng, drv_eng):
        with eng.begin() as conn:
            sids = _fill(conn, random.Random(seed))
    advance = DriverDML(_FINISH.advance_open_at, drv_eng.dialect)
    move = DriverDML(_HEAD_MOVE_IF, drv_eng.dialect)
    log_add = DriverDML(_LOG_ADD, drv_eng.dialect, keys=_ROW_KEYS)
    index = 0
    matched: set[tuple[int, int]] = set()
    for _ in range(60):
        sid, tid, at = rng.choice(sids + ["absent"]), rng.choice(["acme", "other"]), rng.randrange(3)
        if rng.random() < 0.3:
            # a move that matches: an open session at its current turn count (random ones rarely do)
            with core_eng.connect() as conn:
                sid, at = rng.choice(
                    conn.execute(
                        select(SessionRow.id, SessionRow.turn_count).where(
                            SessionRow.status == SessionStatus.OPEN
                        )
                    ).all()
                )
            tid = "acme"
        adv = {
            "sid": sid,
            "tid": tid,
            "next": rng.randrange(9),
            "grown": rng.randrange(99),
            "new_model": rng.choice(["m", "m2", "é"]),
            "open": SessionStatus.OPEN,
            "at": at,
        }
        index += 1
        turn = {
            "session_id": rng.choice(sids),
            "index": index,
            "model": "m",
            "status": rng.choice(list(TurnStatus)),
            "path": rng.choice(["FULL_HIT", "COLD_PREFILL", "GLOBAL_REPLAY"]),
            "reason": "r é",
            "input_tokens": secrets.token_bytes(rng.randrange(0, 64)),
            "output_tokens": b"",
            "cached": rng.randrange(99),
            "replayed_encoder": 0,
            "replayed_decoder": 1,
            "prefilled": 2,
            "mapped": 0,
            "ttft_s": rng.random(),
            "decode_tokens_per_s": rng.choice([None, 1.5]),
            "total_s": rng.random(),
            "persisted": rng.random() < 0.5,
        }
        head = {
            "c": rng.choice(["zz1", "zz2"]),
            "seq0": rng.choice([1, 3]),
            "hash0": rng.choice(["a" * 64, "b" * 64]),
            "seq1": rng.randrange(1 << 40),
            "hash1": secrets.token_hex(32),
        }
        logs = [
            {
                "chain": "acme",
                "seq": index * 10 + k,
                "ts_us": rng.randrange(1 << 52),
                "actor": "storage",
                "action": "store",
                "tenant": "acme",
                "subject": f"chunk:{secrets.token_hex(4)}",
                "reason": "é",
                "nbytes": rng.randrange(1 << 40),
                "prev_hash": "0" * 64,
                "hash": secrets.token_hex(32),
                "source_hash": rng.choice([None, secrets.token_hex(32)]),
            }
            for k in range(rng.randrange(1, 4))
        ]
        with core_eng.begin() as conn:
            core_counts = (
                conn.execute(_FINISH.advance_open_at, adv).rowcount,
                conn.execute(_HEAD_MOVE_IF, head).rowcount,
            )
            conn.execute(_FINISH.add_turn, turn)
            conn.execute(_LOG_ADD, logs)
        with drv_eng.begin() as conn:
            raw = conn.connection.driver_connection
            add_turn = DriverDML(_FINISH.add_turn, drv_eng.dialect, keys=sorted(turn))
            drv_counts = (advance.execute(raw, adv), move.execute(raw, head))
            add_turn.execute(raw, turn)
            log_add.executemany(raw, logs)
        assert core_counts == drv_counts
        matched |= {(i, n) for i, n in enumerate(core_counts)}
    assert {(0, 1), (1, 1), (0, 0)} <= matched
    with core_eng.connect() as a, drv_eng.connect() as b:
        core, drv = _dump(a), _dump(b)
        assert core == drv and len(core["turns"]) == 60 and len(core["audit_log"]) >= 60
        # the stamps are stored alike (same text form), only their instants differ
        q = text("SELECT updated_at FROM sessions UNION ALL SELECT created_at FROM turns")
        assert [len(r[0]) for r in a.execute(q)] == [len(r[0]) for r in b.execute(q)]
        # DriverSelect reads what Connection.execute reads
        for stmt in (
            select(TurnRow.__table__).order_by(TurnRow.__table__.c.id),
            select(SessionRow.__table__),
        ):
            assert (
                DriverSelect(stmt, b.dialect).rows(b.connection.driver_connection, {})
                == b.execute(stmt).all()
            )
    core_eng.dispose(), drv_eng.dispose()


def test_driver_dml_refuses_returning_and_expanding_statements(registry_copy) -> None:
    eng = make_engine(registry_copy("r"))
    with pytest.raises(ValueError, match="RETURNING"):
        DriverDML(_HEAD.update().values(seq=1).returning(_HEAD.c.seq), eng.dialect)
    with pytest.raises(ValueError, match="expanding"):
        DriverDML(_HEAD.delete().where(_HEAD.c.chain.in_(["a", "b"])), eng.dialect)
    assert run_serializable(serializable_factory(eng), lambda s: 1) == 1
    eng.dispose()
