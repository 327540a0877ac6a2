"""The registry writer process (orchestrator/registry_writer/): a node on a SQLite file runs its turns'
finishes there while several turns run, a lone turn's in its own thread; its errors cross back as
themselves; a process killed while idle is replaced unseen; one killed during a finish fails that turn
as UNAVAILABLE with nothing of it kept, and the session goes on. (Its rows equal the in-thread
finish's: tests/orchestrator/engine/test_finish_on_connection.py.)"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from orchestrator.api import PreconditionError
from orchestrator.registry_writer import FinishRequest, RegistryWriter
from orchestrator.settings import Settings
from tests.orchestrator.engine.node_harness import (
    finishes_in_the_writer_process,
    new_session,
    registry,
    run_turn,
    start_node,
)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, 512, (n,), generator=g).tolist()


@pytest.fixture
def node(tmp_path: Path):
    torch.set_num_threads(1)
    n = start_node(tmp_path, registry(), registry_writer="process")
    finishes_in_the_writer_process(n)
    yield n
    n.stop()


def _session_row(node, sid: str) -> tuple[int, int]:
    from sqlalchemy import select

    from orchestrator.db.models import SessionRow

    with node.service.ctx.sessions() as s:
        cols = select(SessionRow.turn_count, SessionRow.history_tokens)
        row = s.execute(cols.where(SessionRow.id == sid)).one()
    return row.turn_count, row.history_tokens


def _turns_at_once(node, sids: list[str], seeds: list[int]) -> None:
    """One turn of each session at once, every turn running when the first one reaches its finish; raises
    the first turn's error."""
    engine = node.service.engine
    gate = threading.Barrier(len(sids))
    real = engine._finish

    def finish_together(*args, **kwargs):
        gate.wait(timeout=30)
        return real(*args, **kwargs)

    errors: list[BaseException] = []

    def turn(sid: str, seed: int) -> None:
        try:
            run_turn(node, sid, _ids(seed, 20))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    engine._finish = finish_together
    try:
        threads = [threading.Thread(target=turn, args=pair) for pair in zip(sids, seeds, strict=True)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    finally:
        engine._finish = real
    if errors:
        raise errors[0]


def _kill(writer: RegistryWriter) -> None:
    proc = writer._proc
    assert proc is not None
    os.kill(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait(timeout=10)


def test_the_finish_runs_in_the_writer_process_and_its_errors_come_back(node, tmp_path: Path) -> None:
    writer = node.service.engine.registry_writer
    assert writer is not None, "a SQLite file registry gets a registry writer process by default"
    sid = new_session(node, "a")
    for i in range(3):
        assert run_turn(node, sid, _ids(i, 20)).stats.persisted
    assert writer.stats()["finishes"] == 3
    assert _session_row(node, sid)[0] == 3
    # a finish for a session that is not there: the process's PreconditionError, raised here
    req = FinishRequest(
        session_id="0" * 32, tenant_id="acme", advance={"sid": "0" * 32, "tid": "acme", "next": 1, "grown": 1,
        "new_model": "a", "open": "OPEN", "at": 0}, new_turn=None, turn_id=None, done={}, segments=None,
        fingerprint="f", claimed=[], node="n",
    )  # fmt: skip
    with pytest.raises(PreconditionError, match="deleted during its turn"):
        writer.finish(req)
    assert node.service.ctx.audit.verify().ok


def test_the_writer_process_writes_its_output_to_the_services_stderr(node) -> None:
    # its stdout is a pipe the parent reads one line from: a log line after it must not go there, where
    # enough of them would block the process
    writer = node.service.engine.registry_writer
    sid = new_session(node, "a")
    run_turn(node, sid, _ids(1, 20))  # the process is up
    pid = writer._proc.proc.pid
    assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2")


def test_a_finish_rolls_back_once_the_service_that_asked_for_it_has_ended(node) -> None:
    # a kill -9 of the service must not leave the writer to commit the finishes it had in flight
    from orchestrator.registry_writer.worker import WriterConfig, _Writer

    engine = node.service.engine
    sid = new_session(node, "a")
    run_turn(node, sid, _ids(1, 20))
    asked: list[FinishRequest] = []

    def keep(req: FinishRequest) -> None:
        asked.append(req)
        raise RuntimeError("not sent")

    engine.registry_writer.finish = keep  # the turn's own request, not run
    with pytest.raises(grpc.RpcError):
        run_turn(node, sid, _ids(2, 20))
    # its store records went back to the store, which mirrored them itself: the request without them
    req = dataclasses.replace(asked[0], claimed=[])
    before = _session_row(node, sid)
    writer = _Writer(WriterConfig(database_url=node.service.ctx.settings.resolved_database_url, authkey=b"k"))
    writer.parent = -1  # as seen once the service is gone: this process was handed to another parent
    with pytest.raises(RuntimeError, match="has ended"):
        writer.op_finish(req)
    assert _session_row(node, sid) == before
    writer.parent = os.getppid()
    writer.op_finish(req)
    assert _session_row(node, sid)[0] == before[0] + 1


def test_a_writer_killed_while_idle_is_replaced_without_a_failed_turn(node) -> None:
    writer = node.service.engine.registry_writer
    sid = new_session(node, "a")
    run_turn(node, sid, _ids(1, 20))
    starts = writer.starts
    _kill(writer)
    assert run_turn(node, sid, _ids(2, 20)).stats.persisted
    assert writer.starts == starts + 1
    assert _session_row(node, sid)[0] == 2


def test_a_writer_killed_during_a_finish_fails_that_turn_and_keeps_nothing_of_it(node) -> None:
    writer = node.service.engine.registry_writer
    sid = new_session(node, "a")
    run_turn(node, sid, _ids(1, 40))
    before = _session_row(node, sid)
    pid = writer._proc.proc.pid
    os.kill(pid, signal.SIGSTOP)  # the next finish is sent and waits for its answer
    failed: list[grpc.RpcError] = []

    def turn() -> None:
        try:
            run_turn(node, sid, _ids(2, 20))
        except grpc.RpcError as exc:
            failed.append(exc)

    th = threading.Thread(target=turn)
    th.start()
    deadline = time.monotonic() + 30
    while node.service.store.audit_acked_seq == node.service.store.audit.head()[0]:
        # the turn wrote its chunks (their records not acknowledged yet) and is waiting for its finish
        assert time.monotonic() < deadline, "the turn never reached its finish"
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    th.join(timeout=30)
    assert failed and failed[0].code() == grpc.StatusCode.UNAVAILABLE, failed
    assert "registry writer" in failed[0].details()
    # nothing of the failed turn is in the registry; the session goes on from where it was
    assert _session_row(node, sid) == before
    assert run_turn(node, sid, _ids(3, 20)).stats.persisted
    assert _session_row(node, sid)[0] == before[0] + 1
    # the failed turn's store records went back to the store, which mirrors them itself
    deadline = time.monotonic() + 30
    while node.service.store.audit_acked_seq != node.service.store.audit.head()[0]:
        assert time.monotonic() < deadline, "the store's records were never mirrored"
        time.sleep(0.05)
    assert node.service.ctx.audit.verify().ok


def test_a_lone_turn_finishes_in_its_thread_and_concurrent_turns_in_the_writer(node) -> None:
    engine = node.service.engine
    writer = engine.registry_writer
    engine.writer_from_running = 2  # the default
    sids = [new_session(node, "a") for _ in range(4)]
    run_turn(node, sids[0], _ids(1, 20))
    assert writer.stats()["finishes"] == 0, "a lone turn's finish went to the writer process"
    # four turns at once: while more than one runs, their finishes go to the writer process
    _turns_at_once(node, sids, [10, 11, 12, 13])
    assert writer.stats()["finishes"] >= 2
    assert [_session_row(node, sid)[0] for sid in sids] == [2, 1, 1, 1]
    assert node.service.ctx.audit.verify().ok


def test_postgres_and_inline_settings_get_no_writer_process(tmp_path: Path) -> None:
    assert Settings().registry_writer == "process"  # the default
    n = start_node(tmp_path, registry(), registry_writer="inline")
    try:
        assert n.service.engine.registry_writer is None
        assert run_turn(n, new_session(n, "a"), _ids(1, 20)).stats.persisted
    finally:
        n.stop()
    with pytest.raises(ValueError, match="registry_writer='thread' must be 'inline' or 'process'"):
        Settings(registry_writer="thread")


def test_the_process_starts_at_the_first_concurrent_turns_and_their_finishes_run_inline_until_it_is_up(
    tmp_path: Path,
) -> None:
    n = start_node(tmp_path, registry(), registry_writer="process")
    try:
        writer = n.service.engine.registry_writer
        sids = [new_session(n, "a") for _ in range(2)]
        run_turn(n, sids[0], _ids(1, 20))
        assert writer.starts == 0, "a node with no concurrent turns started the writer process"
        # two turns at once: the first concurrent finish asks for the process and runs inline meanwhile
        _turns_at_once(n, sids, [5, 6])
        assert [_session_row(n, sid)[0] for sid in sids] == [2, 1]
        deadline = time.monotonic() + 60
        while not writer.started():
            assert time.monotonic() < deadline, "the writer process never started"
            time.sleep(0.05)
        assert writer.starts == 1
        assert n.service.ctx.audit.verify().ok
    finally:
        n.stop()
