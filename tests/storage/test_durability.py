"""Durability and faults: kill -9 mid write loop then reopen and verify, every acknowledged write
synced (strace), a real full filesystem, concurrent writers and readers."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from storage import GlobalKVStore, MissReason, RefusalKind, StoreConfig
from tests.storage import kill_writer
from tests.storage.conftest import CHUNK, FP, payloads_for

ROOT = Path(__file__).resolve().parents[2]


def _spawn_writer(path: Path, n_puts: int, size: int, *, prefix: list[str] | None = None) -> subprocess.Popen:
    cmd = [
        *(prefix or []),
        sys.executable,
        "-m",
        "tests.storage.kill_writer",
        str(path),
        str(n_puts),
        str(size),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


def _kill_after_acks(proc: subprocess.Popen, n_acks: int) -> int:
    acked = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith("ACK "):
            continue  # the child's log lines
        acked = int(line.split()[1])
        if acked + 1 >= n_acks:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=30)
    # Lines already in the pipe were acknowledged too.
    for line in proc.stdout:
        if line.startswith("ACK "):
            acked = max(acked, int(line.split()[1]))
    return acked


def _check_after_crash(path: Path, acked: int, size: int) -> None:
    store = GlobalKVStore(StoreConfig(path=str(path), chunk_tokens=CHUNK, compression_ratios=(4,)))
    try:
        rep = store.recovery
        assert rep.chunks >= 3 * (acked + 1)
        for i in range(acked + 1):
            got = store.longest_valid_prefix("tenant", kill_writer.FP, kill_writer.history(i))
            assert got.miss is None, f"acknowledged put {i} lost: {got.miss}"
            assert got.payloads == list(kill_writer.payloads(i, size).values())
        # Whatever the interrupted put left is whole and valid or absent, never corrupt.
        got = store.longest_valid_prefix("tenant", kill_writer.FP, kill_writer.history(acked + 1))
        assert got.miss is None or got.miss.reason == MissReason.ABSENT
        assert got.payloads == list(kill_writer.payloads(acked + 1, size).values())[: len(got.payloads)]
        assert rep.chunks == 3 * (acked + 1) + len(got.payloads)
        assert store.stats().misses["corrupt"] == 0
        assert store.audit.verify().ok
        assert store.audit.head()[0] == rep.chunks
    finally:
        store.close()


def test_put_chunks_survives_kill_9_during_write_loop(tmp_path) -> None:
    size = 4096
    proc = _spawn_writer(tmp_path / "store", 10_000, size)
    acked = _kill_after_acks(proc, random.Random(1).randrange(20, 40))
    assert proc.returncode == -signal.SIGKILL
    _check_after_crash(tmp_path / "store", acked, size)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(8))
def test_put_chunks_survives_repeated_kill_9(tmp_path, round_) -> None:
    size = 227_840  # one 256-token v41-flash chunk
    for k in range(3):
        path = tmp_path / f"store{k}"
        proc = _spawn_writer(path, 10_000, size)
        acked = _kill_after_acks(proc, random.Random(round_ * 10 + k).randrange(1, 25))
        _check_after_crash(path, acked, size)


def _strace_can_trace() -> bool:
    """Whether strace can trace a child here: it cannot where ptrace is not permitted (a container's
    policy, or this suite itself run under a tracer), and then it exits 1 after creating its output file,
    so the file's presence tells nothing."""
    if shutil.which("strace") is None:
        return False
    probe = subprocess.run(["strace", "-qq", "-o", os.devnull, "true"], capture_output=True, timeout=60)
    return probe.returncode == 0


def test_every_acknowledged_write_was_synced_before_ack(tmp_path) -> None:
    if not _strace_can_trace():
        pytest.skip("needs strace, able to trace a child here, to count sync calls")
    trace = tmp_path / "trace.txt"
    n_puts = 6
    proc = _spawn_writer(
        tmp_path / "store",
        n_puts,
        256,
        prefix=["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=fdatasync,fsync,write"],
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.count("ACK ") == n_puts
    syncs_since_ack = 0
    acks = 0
    for line in trace.read_text().splitlines():
        if re.search(r"\b(fdatasync|fsync)\(", line):
            syncs_since_ack += 1
        elif re.search(r'\bwrite\(1, "ACK', line):
            # Each put is one batch of its 3 chunks, made durable by one WAL sync before it returns.
            assert syncs_since_ack >= 1, f"ACK {acks} with only {syncs_since_ack} syncs before it"
            syncs_since_ack = 0
            acks += 1
    assert acks == n_puts


def test_store_write_options_are_synced(make_store) -> None:
    store = make_store()
    assert store.write_options_synced
    toks = list(range(2 * CHUNK))
    store.put_chunks("tA", "s0", FP, [7] * CHUNK, {(0, CHUNK): b"first"})  # the tenant's salt
    before, syncs = store.stats().synced_writes, store.wal_syncs
    store.put_chunks("tA", "s1", FP, toks, payloads_for(toks))
    # Both chunks in one batch, durable through one WAL sync before put_chunks returned.
    assert (store.stats().synced_writes - before, store.wal_syncs - syncs) == (1, 1)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    return res.returncode == 0


def test_put_chunks_on_full_filesystem_refuses_and_keeps_acknowledged(tmp_path) -> None:
    mnt = tmp_path / "small_fs"
    if not _mount_tmpfs(mnt, "2m"):
        pytest.skip("cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        cfg = StoreConfig(path=str(mnt / "store"), chunk_tokens=CHUNK, compression_ratios=(4,))
        store = GlobalKVStore(cfg)
        written: list[tuple[list[int], bytes]] = []
        refusal = None
        for i in range(1000):
            toks = [i * 10 + j for j in range(CHUNK)]
            pay = os.urandom(16_384)
            res = store.put_chunks("tA", "s", FP, toks, {(0, CHUNK): pay})
            if not res.persisted:
                refusal = res.refusal
                break
            written.append((toks, pay))
        assert refusal is not None and refusal.kind == RefusalKind.IO_ERROR and "space" in refusal.message
        assert len(written) > 10
        for toks, pay in written:
            assert store.longest_valid_prefix("tA", FP, toks).payloads == [pay]
        store.close()
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)
        store = GlobalKVStore(cfg)
        try:
            assert store.recovery.chunks == len(written)
            for toks, pay in written:
                assert store.longest_valid_prefix("tA", FP, toks).payloads == [pay]
            assert store.audit.verify().ok
            assert store.put_chunks("tA", "s", FP, [1] * CHUNK, {(0, CHUNK): b"after"}).persisted
        finally:
            store.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_concurrent_writers_and_readers(make_store) -> None:
    store = make_store()
    shared = [5] * CHUNK
    errors: list[str] = []
    histories: dict[str, tuple[list[int], dict]] = {}

    def writer(w: int) -> None:
        for k in range(6):
            toks = shared + [w * 1000 + k * 10 + j for j in range(CHUNK + 3)]
            pays = {(0, CHUNK): b"shared-prefix"} | {
                r: os.urandom(64) for r in [(CHUNK, 2 * CHUNK), (2 * CHUNK, 2 * CHUNK + 3)]
            }
            res = store.put_chunks("tA", f"w{w}-{k}", FP, toks, pays)
            if not res.persisted:
                errors.append(str(res.refusal))
            histories[f"{w}-{k}"] = (toks, pays)

    def reader() -> None:
        for _ in range(60):
            for toks, pays in list(histories.values()):
                got = store.longest_valid_prefix("tA", FP, toks)
                if got.miss is not None and got.miss.reason != MissReason.ABSENT:
                    errors.append(f"unexpected miss {got.miss}")
                want = [pays[r] for r in sorted(pays)]
                if got.payloads[1:] != want[1 : len(got.payloads)]:
                    errors.append("reader saw wrong payload")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.stats().chunks == 1 + 4 * 6 * 2
    for toks, _ in histories.values():
        assert store.longest_valid_prefix("tA", FP, toks).n_tokens == len(toks)
    assert store.audit.verify().ok
    assert store.purge_session("tA", "w0-0", actor="t").chunks_deleted == 2
    assert store.longest_valid_prefix("tA", FP, histories["1-0"][0]).n_tokens == len(histories["1-0"][0])
