"""`kvresume admin store check|repair` on a real store directory: check reads without changing it and
exits 1 on damage (0 when healthy); repair quarantines, starts the store empty and removes the copy;
a newer format makes both fail (exit 1) with nothing moved."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rocksdict import Options, Rdict

from orchestrator.cli import main
from storage import GlobalKVStore, StoreConfig
from tests.chaos.store_damage import sst_bitflips


def _write(data_dir: Path) -> None:
    store = GlobalKVStore(StoreConfig(path=str(data_dir / "kv"), chunk_tokens=256, compression_ratios=(4,)))
    rng = random.Random(1)
    for i in range(8):
        toks = [rng.randrange(1, 999) for _ in range(512)]
        pays = {(0, 256): rng.randbytes(4000), (256, 512): rng.randbytes(4000)}
        assert store.put_chunks("acme", f"s{i}", "fp", toks, pays).persisted
    store.close()


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    code = main(["admin", "store", *argv, "--json", str(out)])
    return code, json.loads(out.read_text())


def test_store_check_and_repair(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    flags = ("--data-dir", str(tmp_path))
    code, doc = _run(tmp_path, "check", *flags)
    assert code == 0 and doc["status"] == "ok" and doc["chunks"] == 16 and doc["audit_ok"] is True

    sst_bitflips(tmp_path / "kv" / "db", random.Random(2))
    before = sorted(p.name for p in (tmp_path / "kv" / "db").iterdir())
    code, doc = _run(tmp_path, "check", *flags)
    assert code == 1 and doc["status"] == "damaged" and not doc["ok"] and "Corruption" in doc["detail"]
    assert sorted(p.name for p in (tmp_path / "kv" / "db").iterdir()) == before

    code, doc = _run(tmp_path, "repair", "--keep-quarantined", *flags)
    assert code == 0 and doc["quarantined"]["reason"] == "damaged_at_open" and doc["removed"] == []
    code, doc = _run(tmp_path, "check", *flags)
    assert code == 0 and doc["status"] == "ok" and doc["chunks"] == 0 and len(doc["quarantined"]) == 1
    code, doc = _run(tmp_path, "repair", *flags)
    assert code == 0 and doc["quarantined"] is None and len(doc["removed"]) == 1
    assert not any((tmp_path / "kv" / "quarantine").iterdir())


def test_store_newer_format_fails_with_nothing_moved(tmp_path: Path, capsys) -> None:
    _write(tmp_path)
    db = Rdict(str(tmp_path / "kv" / "db"), Options(raw_mode=True))
    db.put(b"V", b"kvresume-store-9")
    db.close()
    code, doc = _run(tmp_path, "check", "--data-dir", str(tmp_path))
    assert code == 1 and doc["status"] == "newer_version"
    assert main(["admin", "store", "repair", "--data-dir", str(tmp_path)]) == 1
    assert "newer than this code's" in capsys.readouterr().err
    assert not (tmp_path / "kv" / "quarantine").exists()
