"""Opening a store so that damage degrades it instead of stopping the node, and the same offline:
`check_store` (read only) and `repair_store` (what `kvresume admin store check|repair` run).

Knows nothing of the service. The store is a cache of what SQL holds authoritatively, so a database
that cannot be read whole is moved aside (quarantine.py) and the node starts with an empty one, whose
audit chain begins with the quarantine record; the caller reconciles SQL rows against it. Only a
store of a newer format version refuses: it is not damaged, and a downgrade must never wipe it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from rocksdict import AccessType, Options, Rdict

from storage.audit_record import AuditRecord
from storage.audit_rocks import RocksAuditSink
from storage.chunk_index import FORMAT
from storage.errors import StoreDamagedError, StoreFormatError, StoreVersionError
from storage.kv_store import GlobalKVStore
from storage.quarantine import QuarantineArea, QuarantinedStore
from storage.store_config import StoreConfig
from storage.store_scan import check_format_mark, read_all, scan_store


class QuarantineReason(StrEnum):
    """Why a database was moved aside; the audit record's reason. Never rename a value."""

    DAMAGED_AT_OPEN = "damaged_at_open"
    READ_ERROR_WHILE_SERVING = "read_error_while_serving"
    NO_FORMAT_MARK = "no_format_mark"


def _reason(exc: Exception, area: QuarantineArea) -> QuarantineReason:
    if isinstance(exc, StoreDamagedError) and area.damage_mark() is not None:
        return QuarantineReason.READ_ERROR_WHILE_SERVING
    if not isinstance(exc, StoreDamagedError):
        return QuarantineReason.NO_FORMAT_MARK
    return QuarantineReason.DAMAGED_AT_OPEN


def open_store(
    config: StoreConfig,
    *,
    clock: Callable[[], float] = time.time,
    on_audit: Callable[[list[AuditRecord]], None] | None = None,
    hold_audit: bool = False,
    actor: str = "storage",
) -> GlobalKVStore:
    """Open the store; if its database is damaged, quarantine it and open an empty one.

    The returned store's `quarantined_at_open` names the entry moved aside (None when none was), and
    its `health()` reports `quarantined` until that copy is removed. `hold_audit`: see GlobalKVStore.

    Raises:
        StoreVersionError: the database is of a newer format; nothing was moved or written.
        StoreLockedError: another process has the database open; nothing was moved or written.
        OSError: the damaged database could not be moved aside.
    """
    # Read-only first: a newer store must not even be opened for writing (that rewrites its MANIFEST).
    refuse_newer_format(config)
    area = QuarantineArea(config.path)
    try:
        store = GlobalKVStore(config, clock=clock, on_audit=on_audit, hold_audit=hold_audit)
        store.quarantined_at_open = None
        return store
    except StoreVersionError:
        raise
    except (StoreDamagedError, StoreFormatError) as exc:
        entry = area.move_aside(
            config.db_path, config.checkpoint_dir, reason=_reason(exc, area).value, detail=str(exc)
        )
    store = GlobalKVStore(config, clock=clock, on_audit=on_audit, hold_audit=hold_audit)
    store.record_quarantine(entry, actor=actor)
    store.quarantined_at_open = entry
    return store


def refuse_newer_format(config: StoreConfig) -> None:
    """Raise before anything else is opened when the store is of a newer format; otherwise return
    (a missing, unreadable or damaged database is for `open_store` to handle). Reads only.

    Raises:
        StoreVersionError: the format mark names a newer version.
    """
    if not (config.db_path / "CURRENT").is_file():
        return
    try:
        db = Rdict(str(config.db_path), Options(raw_mode=True), access_type=AccessType.read_only())
    except Exception:  # noqa: BLE001 - a database that does not open is damage, open_store's concern
        return
    try:
        mark = db.get(FORMAT)
    except Exception:  # noqa: BLE001 - as above: an unreadable mark is damage
        mark = None
    finally:
        db.close()
    if mark is None:
        return
    try:
        check_format_mark(mark, str(config.db_path))
    except StoreDamagedError:
        return


class CheckStatus(StrEnum):
    OK = "ok"
    EMPTY = "empty"
    DAMAGED = "damaged"
    NEWER_VERSION = "newer_version"


@dataclass(frozen=True, kw_only=True)
class StoreCheck:
    """What `check_store` found. `audit_ok` is the store chain's own verdict (None when not read)."""

    status: CheckStatus
    detail: str
    entries: int
    chunks: int
    leftovers: int
    audit_ok: bool | None
    audit_detail: str
    quarantined: list[QuarantinedStore] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return self.status in (CheckStatus.OK, CheckStatus.EMPTY)

    def to_dict(self) -> dict[str, object]:
        return {
            "status": self.status.value,
            "detail": self.detail,
            "entries": self.entries,
            "chunks": self.chunks,
            "leftovers": self.leftovers,
            "audit_ok": self.audit_ok,
            "audit_detail": self.audit_detail,
            "quarantined": [q.to_dict() for q in self.quarantined],
        }


def check_store(config: StoreConfig) -> StoreCheck:
    """Inspect the store offline without writing anything: open the database read-only, read every
    block, decode the store's entries as recovery would, and verify the store's audit chain.

    A store in use by a running node may be checked too (a read-only open takes no lock), but it then
    shows the state of its files at that moment.
    """
    area = QuarantineArea(config.path)
    quarantined = area.list()

    def result(status: CheckStatus, detail: str, **figures: object) -> StoreCheck:
        fields = {"entries": 0, "chunks": 0, "leftovers": 0, "audit_ok": None, "audit_detail": ""}
        fields.update(figures)
        return StoreCheck(status=status, detail=detail, quarantined=quarantined, **fields)  # type: ignore[arg-type]

    where = str(config.db_path)
    mark = area.damage_mark()
    if mark is not None:
        return result(CheckStatus.DAMAGED, f"a read error was recorded while serving: {mark}")
    if not (config.db_path / "CURRENT").exists() and not any(config.db_path.glob("*")):
        return result(CheckStatus.EMPTY, f"no database at {where}")
    try:
        db = Rdict(where, Options(raw_mode=True), access_type=AccessType.read_only())
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a plain Exception for every RocksDB status
        return result(CheckStatus.DAMAGED, f"the database does not open: {exc}")
    try:
        try:
            entries = read_all(db, where)
            found = scan_store(db, where)
        except StoreVersionError as exc:
            return result(CheckStatus.NEWER_VERSION, str(exc))
        except (StoreDamagedError, StoreFormatError) as exc:
            return result(CheckStatus.DAMAGED, str(exc))
        try:
            verdict = RocksAuditSink(db).verify()
            audit_ok, audit_detail = verdict.ok, verdict.reason or ""
        except Exception as exc:  # noqa: BLE001 - a head or record that does not decode is a failed check
            audit_ok, audit_detail = False, str(exc)
        return result(
            CheckStatus.OK,
            "the database reads whole and every store entry decodes",
            entries=entries,
            chunks=len(found.chunks),
            leftovers=len(found.leftovers),
            audit_ok=audit_ok,
            audit_detail=audit_detail,
        )
    finally:
        db.close()


@dataclass(frozen=True, kw_only=True)
class StoreRepair:
    """What `repair_store` did: the entry it moved aside (if the live store was damaged) and the
    quarantined copies it removed."""

    quarantined: QuarantinedStore | None
    removed: list[QuarantinedStore]
    chunks: int

    def to_dict(self) -> dict[str, object]:
        return {
            "quarantined": self.quarantined.to_dict() if self.quarantined is not None else None,
            "removed": [q.to_dict() for q in self.removed],
            "chunks": self.chunks,
        }


def repair_store(config: StoreConfig, *, keep_quarantined: bool = False, actor: str = "admin") -> StoreRepair:
    """Offline: do what the node does at open (quarantine a damaged database, start empty), then
    remove the quarantined copies (their data is recomputed from SQL-held history on demand) unless
    `keep_quarantined`. Each step is an audit record in the live store's chain, delivered to the SQL
    log when the node next starts.

    Raises:
        StoreVersionError: a newer format; nothing was moved or written.
        StoreLockedError: a running node (or another process) has the store open; stop it first.
    """
    # Its records stay unacknowledged: the node mirrors them into SQL when it next opens the store.
    store = open_store(config, hold_audit=True, actor=actor)
    try:
        removed: list[QuarantinedStore] = []
        if not keep_quarantined:
            removed = store.remove_quarantined(actor=actor, reason="repaired")
        chunks = store.stats().chunks
        return StoreRepair(quarantined=store.quarantined_at_open, removed=removed, chunks=chunks)
    finally:
        store.close()
