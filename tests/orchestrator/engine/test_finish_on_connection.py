"""TurnEngine._finish in the registry writer process (SQLite's default, orchestrator/registry_writer/) and
on a Core Connection in the turn's thread (`run_serializable_connection`, `registry_writer = "inline"`)
against their twin, the same statements in an ORM Session (`run_serializable`): three nodes with the
same tenant salts (registry and store) and session ids run the same random turns (new sessions, growing
histories that supersede tail chunks, a session closed before its turn), one each way, and their
registries are read whole."""

from __future__ import annotations

import datetime as dt
import itertools
import random
import secrets
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from sqlalchemy import select

from orchestrator.db import run_serializable
from orchestrator.db.models import (
    AuditHead,
    AuditRow,
    CacheSegment,
    SessionRow,
    SessionSegment,
    Tenant,
    TurnRow,
)
from tests.orchestrator.engine.node_harness import (
    finishes_in_the_writer_process,
    md,
    registry,
    run_turn,
    start_node,
)

# per-turn timings and the store's record stamps (and the hashes over them) differ between two runs
_TIMED = {"ttft_s", "decode_tokens_per_s", "total_s", "ts_us", "hash", "prev_hash", "source_hash"}


def _dump(node: Any) -> dict[str, list[tuple]]:
    out = {}
    with node.service.ctx.engine.connect() as conn:
        for model in (Tenant, SessionRow, TurnRow, CacheSegment, SessionSegment, AuditHead, AuditRow):
            table = model.__table__
            rows = conn.execute(select(table).order_by(*table.primary_key.columns)).mappings().all()
            out[table.name] = [
                tuple(
                    type(v) if isinstance(v, dt.datetime) or k in _TIMED else v
                    for k, v in row.items()
                    if k != "salt"
                )
                for row in rows
            ]
    return out


@pytest.fixture
def twins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    torch.set_num_threads(1)
    # Session ids from one counter per node (the same sequence on both), keyed by what each node asked.
    counters: dict[str, itertools.count] = {}
    current = {"node": ""}

    def uuid4() -> Any:
        n = next(counters.setdefault(current["node"], itertools.count()))
        return SimpleNamespace(hex=f"{n:032x}")

    import orchestrator.db.repositories.session_create as session_create_module
    import orchestrator.db.repositories.sessions as sessions_module

    for module in (sessions_module, session_create_module):
        monkeypatch.setattr(module, "uuid", SimpleNamespace(uuid4=uuid4))
    salt = secrets.token_bytes(32)
    # the store's own tenant salt too (its chunk keys)
    import storage.kv_store as kv_store_module

    monkeypatch.setattr(kv_store_module, "secrets", SimpleNamespace(token_bytes=lambda n: salt[:n]))
    nodes = {}
    for name in ("process", "connection", "session"):
        writer = "process" if name == "process" else "inline"
        node = start_node(tmp_path / name, registry(), registry_writer=writer)
        node.service.engine.finish_on_connection = name != "session"
        finishes_in_the_writer_process(node)
        # the same tenant salt on every node: the same store keys and audit subjects
        run_serializable(node.service.ctx.serializable, lambda s: s.add(Tenant(id="acme", salt=salt)))
        nodes[name] = node
    # how many finishes ran on a Connection in this process (the nodes share the module)
    import orchestrator.engine.turn_engine as turn_engine_module

    ran = {"connection": 0}
    real = turn_engine_module.run_serializable_connection

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran["connection"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(turn_engine_module, "run_serializable_connection", counted)
    yield nodes, current, ran
    for node in nodes.values():
        node.stop()


def test_finish_in_the_writer_process_and_on_connection_write_what_the_session_path_writes(twins) -> None:
    nodes, current, ran = twins
    rng = random.Random(secrets.randbits(64))
    script: list[tuple[str, int, list[int]]] = []
    sessions = 0
    for step in range(10):
        if sessions == 0 or rng.random() < 0.3:
            script.append(("create", sessions, []))
            sessions += 1
        which = rng.randrange(sessions)
        # never before the first turn, which then always finishes (a script whose only session closed
        # before its first turn would compare two runs of nothing but refusals)
        if step > 0 and rng.random() < 0.1:
            script.append(("close", which, []))
        # 1-70 tokens: chunks of 32 tokens, so tails are superseded and whole chunks added
        script.append(("turn", which, [rng.randrange(16, 512) for _ in range(rng.randrange(1, 70))]))
    outcomes: dict[str, list[Any]] = {}
    for name, node in nodes.items():
        current["node"] = name
        sids: list[str] = []
        seen: list[Any] = []
        for op, i, ids in script:
            if op == "create":
                req = node.pb.sessions.CreateSessionRequest(model="a")
                sids.append(node.sessions.CreateSession(req, metadata=md()).session.session_id)
            elif op == "close":
                req = node.pb.sessions.CloseSessionRequest(session_id=sids[i])
                node.sessions.CloseSession(req, metadata=md())
            else:
                try:
                    result = run_turn(node, sids[i], ids)
                    seen.append((result.path, result.tokens, result.stats.persisted))
                except grpc.RpcError as exc:
                    seen.append(exc.code())
        outcomes[name] = seen
    assert outcomes["process"] == outcomes["connection"] == outcomes["session"]
    finished = sum(isinstance(o, tuple) for o in outcomes["connection"])
    assert finished, "no turn ran"
    # every finish of the connection node went that way, none of the session node's; every finish of
    # the process node ran in its writer process
    assert ran["connection"] == finished
    assert nodes["process"].service.engine.registry_writer.stats()["finishes"] == finished
    twin = _dump(nodes["session"])
    for name in ("process", "connection"):
        assert _dump(nodes[name]) == twin, name
    assert twin["audit_log"] and twin["session_segments"], "the script stored nothing"
    for node in nodes.values():
        assert node.service.ctx.audit.verify().ok
