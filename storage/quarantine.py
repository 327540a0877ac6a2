"""The quarantine area of a store root: damaged databases moved aside whole, never edited in place.

Knows nothing of the store object; the store (kv_store.py) and the opener (store_open.py) call it.
A damaged store's database directory and its checkpoints move, by rename on the same filesystem, to
`<root>/quarantine/<name>/` beside a `quarantine.json` saying when and why. The copy still holds
tenant data, so the store keeps it under its rules: it counts against capacity (first to go when a
write needs room), any purge removes it (its entries cannot be selected by tenant, session or model
in a database that cannot be read), and it is removed once past the longest ceiling of any policy
or when an operator repairs the store (`kvresume admin store repair`).

A read error while serving leaves a `damaged.json` mark at the root (outside RocksDB, which may no
longer be writable), so the next open quarantines the database even if that open reads it cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

QUARANTINE_DIR = "quarantine"
DAMAGE_MARK = "damaged.json"
INFO_FILE = "quarantine.json"


@dataclass(frozen=True, kw_only=True)
class QuarantinedStore:
    """One database moved aside. `nbytes` is the size of every file in its directory."""

    name: str
    path: Path
    quarantined_at: float
    reason: str
    detail: str
    nbytes: int

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "path": str(self.path),
            "quarantined_at": self.quarantined_at,
            "reason": self.reason,
            "detail": self.detail,
            "nbytes": self.nbytes,
        }


def _tree_bytes(path: Path) -> int:
    """Bytes of the files an entry holds, its own info file excepted (it records this figure)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            if name == INFO_FILE and Path(dirpath) == path:
                continue
            try:
                total += (Path(dirpath) / name).lstat().st_size
            except OSError:
                continue
    return total


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class QuarantineArea:
    """The `quarantine/` folder under one store root (`root` = StoreConfig.path)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.dir = self.root / QUARANTINE_DIR

    def damage_mark(self) -> str | None:
        """The detail of a read error recorded while serving, or None."""
        path = self.root / DAMAGE_MARK
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"damage mark unreadable: {exc}"
        try:
            obj = json.loads(raw)
            return str(obj.get("detail", raw)) if isinstance(obj, dict) else raw
        except ValueError:
            return raw[:500]

    def mark_damaged(self, detail: str, *, now: float) -> None:
        """Record a read error for the next open; best effort (the disk may be failing too)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / DAMAGE_MARK).write_text(json.dumps({"detail": detail, "at": now}))
        except OSError as exc:
            log.error("store_damage_mark_failed", error=str(exc))

    def move_aside(
        self, db_path: Path, checkpoint_dir: Path, *, reason: str, detail: str
    ) -> QuarantinedStore:
        """Move the database (and its checkpoints and damage mark) into a new quarantine entry.

        Raises:
            OSError: the rename failed (then nothing was moved, or only the database: the next open
                finds an empty database directory and starts empty either way).
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        stamp = time.time()
        base = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(stamp))
        name, n = base, 1
        while (self.dir / name).exists():
            n += 1
            name = f"{base}-{n}"
        target = self.dir / name
        target.mkdir()
        if db_path.exists():
            db_path.rename(target / "db")
        if checkpoint_dir.exists():
            checkpoint_dir.rename(target / "checkpoints")
        mark = self.root / DAMAGE_MARK
        if mark.exists():
            mark.rename(target / DAMAGE_MARK)
        nbytes = _tree_bytes(target)
        entry = QuarantinedStore(
            name=name, path=target, quarantined_at=stamp, reason=reason, detail=detail, nbytes=nbytes
        )
        info = {k: v for k, v in entry.to_dict().items() if k not in ("path", "name")}
        (target / INFO_FILE).write_text(json.dumps(info, sort_keys=True))
        _fsync_dir(target)
        _fsync_dir(self.dir)
        _fsync_dir(self.root)
        log.warning("store_quarantined", name=name, reason=reason, detail=detail, bytes=nbytes)
        return entry

    def list(self) -> list[QuarantinedStore]:
        """Every quarantine entry, oldest first. An entry without a readable info file (a move cut
        short by a crash) is listed with its directory's modification time and reason `unknown`."""
        if not self.dir.is_dir():
            return []
        out: list[QuarantinedStore] = []
        for path in self.dir.iterdir():
            if not path.is_dir():
                continue
            try:
                info = json.loads((path / INFO_FILE).read_text())
                at, reason, detail = float(info["quarantined_at"]), str(info["reason"]), str(info["detail"])
            except (OSError, ValueError, KeyError, TypeError):
                at, reason, detail = path.stat().st_mtime, "unknown", ""
            out.append(
                QuarantinedStore(
                    name=path.name,
                    path=path,
                    quarantined_at=at,
                    reason=reason,
                    detail=detail,
                    nbytes=_tree_bytes(path),
                )
            )
        return sorted(out, key=lambda q: (q.quarantined_at, q.name))

    def remove(self, entry: QuarantinedStore) -> None:
        """Delete one entry's files (its tenant data leaves the disk)."""
        shutil.rmtree(entry.path, ignore_errors=True)
        if entry.path.exists():
            raise OSError(f"could not remove quarantined store {entry.path}")
        log.info("quarantined_store_removed", name=entry.name, bytes=entry.nbytes)
