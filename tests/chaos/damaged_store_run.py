"""One chaos case: a store written through its public API, damaged on disk, opened again the way the
node opens it (`open_store`), then every stored session read back and compared with what was written.

"Hit on damaged data" means a payload returned by a read that differs from the bytes stored for that
range; the suite requires 0 of them, and 0 refusals to start.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from storage import AuditAction, GlobalKVStore, HealthReason, RetentionPolicy, StoreConfig, open_store
from tests.chaos.store_damage import DAMAGES
from tests.storage import kill_writer

CHUNK = 8
FP = "chaos-fp"
REPO_ROOT = Path(__file__).resolve().parents[2]


def store_config(root: Path) -> StoreConfig:
    return StoreConfig(path=str(root), chunk_tokens=CHUNK, compression_ratios=(4,))


Written = dict[tuple[str, str], tuple[list[int], dict[tuple[int, int], bytes]]]


def write_store(root: Path, seed: int, *, tenants: int = 3, sessions: int = 6) -> Written:
    """Tenants with policies and sessions of 3-6 full chunks plus a tail, some sharing prefixes."""
    rng = random.Random(seed)
    written: Written = {}
    store = GlobalKVStore(store_config(root))
    try:
        for t in range(tenants):
            tenant = f"tenant-{t}"
            store.set_policy(tenant, RetentionPolicy(floor_s=3600.0, ceiling_s=7 * 86400.0), actor="chaos")
            shared = [rng.randrange(1, 50_000) for _ in range(2 * CHUNK)]
            for s in range(sessions):
                n = CHUNK * rng.randint(3, 6) + rng.randint(1, CHUNK - 1)
                toks = (shared if s % 2 else []) + [rng.randrange(1, 50_000) for _ in range(n)]
                pays = {
                    (a, min(a + CHUNK, len(toks))): rng.randbytes(rng.randint(200, 3000))
                    for a in range(0, len(toks), CHUNK)
                }
                # Shared chunks keep the bytes of their first store: read back what the store holds.
                result = store.put_chunks(tenant, f"s{s}", FP, toks, pays)
                assert result.persisted, result.refusal
                got = store.longest_valid_prefix(tenant, FP, toks)
                written[(tenant, f"s{s}")] = (toks, dict(zip(got.ranges, got.payloads, strict=True)))
    finally:
        store.close()
    return written


def write_killed(root: Path, *, acks: int = 40, size: int = 2000) -> tuple[Written, Path]:
    """Run tests/storage/kill_writer.py, kill -9 it after `acks` acknowledged puts, and return what
    was acknowledged (the directory then holds what a crash leaves, WAL included)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.storage.kill_writer", str(root), "100000", str(size)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    done = -1
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ACK "):
            done = int(line.split()[1])
            if done + 1 >= acks:
                break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written: Written = {}
    for i in range(done + 1):
        written[("tenant", f"s{i}")] = (kill_writer.history(i), kill_writer.payloads(i, size))
    return written, root


@dataclass(kw_only=True)
class CaseResult:
    damage: str
    seed: int
    what: str
    started: bool
    quarantined: bool
    health_reasons: list[str]
    sessions: int
    chunks_written: int
    chunks_served: int
    wrong_hits: int
    corrupt_misses: int
    audit_first_action: str


def run_case(tmp: Path, damage: str, seed: int, *, killed: bool = False) -> CaseResult:
    root = tmp / f"{damage}-{seed}"
    shutil.rmtree(root, ignore_errors=True)
    if killed:
        written, _ = write_killed(root)
    else:
        written = write_store(root, seed)
    what = DAMAGES[damage](root / "db", random.Random(seed))
    try:
        store = open_store(store_config(root))
    except Exception:  # noqa: BLE001 - a refusal to start is the figure this case measures
        return CaseResult(
            damage=damage,
            seed=seed,
            what=what,
            started=False,
            quarantined=False,
            health_reasons=[],
            sessions=len(written),
            chunks_written=0,
            chunks_served=0,
            wrong_hits=0,
            corrupt_misses=0,
            audit_first_action="",
        )
    try:
        served = wrong = corrupt = 0
        for (tenant, _session), (toks, pays) in written.items():
            got = store.longest_valid_prefix(tenant, kill_writer.FP if killed else FP, toks)
            for rng_, payload in zip(got.ranges, got.payloads, strict=True):
                served += 1
                wrong += pays.get(rng_) != payload
            corrupt += got.miss is not None and got.miss.reason.value == "corrupt"
        health = store.health()
        first = next(iter(store.audit.iter_records()), None)
        quarantined = store.quarantined_at_open is not None
        if quarantined:
            assert HealthReason.QUARANTINED in health.reasons
            assert first is not None and first.action == AuditAction.QUARANTINE
        return CaseResult(
            damage=damage,
            seed=seed,
            what=what,
            started=True,
            quarantined=quarantined,
            health_reasons=[r.value for r in health.reasons],
            sessions=len(written),
            chunks_written=sum(len(p) for _, p in written.values()),
            chunks_served=served,
            wrong_hits=wrong,
            corrupt_misses=corrupt,
            audit_first_action=first.action.value if first is not None else "",
        )
    finally:
        store.close()
