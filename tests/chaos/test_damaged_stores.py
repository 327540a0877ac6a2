"""Seeded damage to real RocksDB directories written through the store's API (and by a writer killed
with SIGKILL for the WAL cases): every damaged store opens (quarantined when it cannot be read whole),
and no read ever returns bytes other than those stored. Figures go to the chaos report (conftest.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pytest

from storage import StoreVersionError, open_store
from tests.chaos.damaged_store_run import run_case, store_config, write_store
from tests.chaos.store_damage import DAMAGES

WAL_DAMAGES = ("wal_bitflips", "wal_truncate")
# One of each kind of harm for the default suite: file bytes, a file RocksDB needs, an entry of ours,
# a value edit readable by RocksDB but failing its own checksum.
DEFAULT_SUBSET = (
    "sst_bitflips",
    "current_garbage",
    "clock_mark_2_bytes",
    "policy_invalid_json",
    "chunk_value_edits",
)


def _summary(results: list[dict]) -> dict[str, object]:
    return {
        "damaged_stores": len(results),
        "refusals_to_start": sum(not r["started"] for r in results),
        "quarantined": sum(r["quarantined"] for r in results),
        "wrong_hits": sum(r["wrong_hits"] for r in results),
        "chunks_served": sum(r["chunks_served"] for r in results),
        "chunks_written": sum(r["chunks_written"] for r in results),
        "corrupt_misses": sum(r["corrupt_misses"] for r in results),
        "by_damage": {
            r["damage"] + f"#{r['seed']}": {
                k: r[k] for k in ("what", "quarantined", "wrong_hits", "chunks_served", "health_reasons")
            }
            for r in results
        },
    }


def _assert_clean(results: list[dict]) -> None:
    bad = [r for r in results if not r["started"] or r["wrong_hits"]]
    assert not bad, bad
    for r in results:
        # A store that opened without quarantine still holds readable data; a quarantined one is empty.
        if r["quarantined"]:
            assert r["chunks_served"] == 0, r


def test_damaged_stores_default_subset(tmp_path: Path, chaos_report) -> None:
    t0 = time.monotonic()
    results = [asdict(run_case(tmp_path, name, seed=1)) for name in DEFAULT_SUBSET]
    chaos_report.record("damaged_stores_default", wall_s=round(time.monotonic() - t0, 2), **_summary(results))
    _assert_clean(results)
    assert sum(r["quarantined"] for r in results) >= 3


@pytest.mark.slow
def test_damaged_stores_catalogue(tmp_path: Path, chaos_report) -> None:
    t0 = time.monotonic()
    results = []
    for seed in (11, 12):
        for name in DAMAGES:
            if name in WAL_DAMAGES:
                continue
            results.append(asdict(run_case(tmp_path, name, seed=seed)))
    for seed in (21, 22, 23):
        for name in WAL_DAMAGES:
            results.append(asdict(run_case(tmp_path, name, seed=seed, killed=True)))
    chaos_report.record("damaged_stores_slow", wall_s=round(time.monotonic() - t0, 2), **_summary(results))
    assert len(results) >= 25
    _assert_clean(results)


def test_newer_format_version_refuses_and_touches_nothing(tmp_path: Path) -> None:
    from rocksdict import Options, Rdict

    root = tmp_path / "newer"
    write_store(root, seed=3, tenants=1, sessions=2)
    db = Rdict(str(root / "db"), Options(raw_mode=True))
    db.put(b"V", b"kvresume-store-2")
    db.close()
    before = {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    with pytest.raises(StoreVersionError, match="newer than this code's"):
        open_store(store_config(root))
    after = {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert after == before
    assert not (root / "quarantine").exists()


@pytest.mark.slow
def test_serve_refuses_a_newer_store_with_exit_1_and_touches_nothing(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from rocksdict import Options, Rdict

    from tests.chaos.damaged_store_run import REPO_ROOT

    write_store(tmp_path / "kv", seed=4, tenants=1, sessions=1)
    db = Rdict(str(tmp_path / "kv" / "db"), Options(raw_mode=True))
    db.put(b"V", b"kvresume-store-2")
    db.close()
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    env = {**os.environ, "KVRESUME_TENANT_TOKENS": "acme=x", "KVRESUME_ADMIN_TOKEN": "y"}
    argv = ["serve", "--data-dir", str(tmp_path), "--models", "a=random:v41-tiny@1", "--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *argv],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "kvresume serve: error:" in done.stderr and "newer than this code's" in done.stderr
    assert "Traceback" not in done.stderr
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before
