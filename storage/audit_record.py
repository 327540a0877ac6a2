"""The audit record and its hash chain: one format shared by every audit sink (RocksDB here, SQL in
orchestrator/). Knows nothing of where records are kept.

A record's `hash` is sha256 over the previous record's hash (32 raw bytes) followed by the record's
canonical body: sorted-key compact JSON, utf-8, of every field except `hash`. The first record has
seq 1 and prev_hash GENESIS_HASH. An edited record changes its own hash; a reordered, inserted or
deleted record breaks the seq run or the prev_hash link of its successor; deleting the newest records
is detected by comparing with the head (last seq and hash) that a sink keeps apart from the records.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from enum import StrEnum

from storage.errors import AuditRecordError

GENESIS_HASH = "0" * 64
"""prev_hash of the first record of every chain (seq 1)."""


class AuditAction(StrEnum):
    """What happened. The string values are part of the chain format: never rename one."""

    STORE = "store"
    READ_CORRUPT = "read_corrupt"
    EXPIRE = "expire"
    EVICT = "evict"
    REFUSE = "refuse"
    PURGE = "purge"
    POLICY_CHANGE = "policy_change"
    CHECKPOINT = "checkpoint"
    QUARANTINE = "quarantine"


@dataclass(frozen=True, kw_only=True)
class AuditEvent:
    """What a caller asks a sink to append; the sink adds seq, ts_us and the hashes.

    Args:
        actor: who did it (`"storage"`, `"maintenance"`, an admin or service identity).
        action: what happened.
        tenant: the tenant it concerns, `""` when none (a model-wide purge).
        subject: what it concerns (`"chunk:<hex>"`, `"session:<id>"`, `"model:<fp>"`), never payload bytes.
        reason: why, as a short snake_case fact (`"past_ceiling"`, `"capacity_lru"`, `"checksum_mismatch"`).
        nbytes: bytes written, freed or refused by this action (0 when none).
    """

    actor: str
    action: AuditAction
    tenant: str
    subject: str
    reason: str
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.action, AuditAction):
            object.__setattr__(self, "action", AuditAction(self.action))
        if self.nbytes < 0:
            raise ValueError(f"audit event nbytes must be >= 0, got {self.nbytes}")
        if not self.actor:
            raise ValueError("audit event actor must be non-empty")


@dataclass(frozen=True, kw_only=True)
class AuditRecord:
    """One sealed record of the append-only, hash-chained audit log.

    Fields are those of AuditEvent plus `seq` (1, 2, ... without gaps), `ts_us` (integer microseconds
    since the epoch, from the sink's clock), `prev_hash` and `hash` (64 lowercase hex characters).
    """

    seq: int
    ts_us: int
    actor: str
    action: AuditAction
    tenant: str
    subject: str
    reason: str
    nbytes: int
    prev_hash: str
    hash: str

    def body_fields(self) -> dict[str, object]:
        """Every field except `hash`, as JSON-ready values (the action as its string value)."""
        # The field names are read once (`_BODY_NAMES`): every store write seals and encodes records.
        out = {name: getattr(self, name) for name in _BODY_NAMES}
        out["action"] = str(self.action)
        return out

    def canonical_body(self) -> bytes:
        """The bytes the hash covers after prev_hash: sorted-key compact JSON of body_fields(), utf-8."""
        return canonical_json(self.body_fields())

    def to_json(self) -> bytes:
        """Full record (hash included) as canonical JSON bytes; `from_json` inverts it exactly."""
        # The fields are flat values (no nested dataclass or container), so this is `asdict(self)`
        # without its deep copy of each value.
        out = {name: getattr(self, name) for name in _RECORD_NAMES}
        out["action"] = str(self.action)
        return canonical_json(out)

    @classmethod
    def from_json(cls, data: bytes | str) -> AuditRecord:
        """Decode `to_json` output.

        Raises:
            AuditRecordError: the data is not a JSON object with exactly the record's fields.
        """
        try:
            obj = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AuditRecordError(f"audit record is not JSON: {exc}") from exc
        names = {f.name for f in fields(cls)}
        if not isinstance(obj, dict) or set(obj) != names:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise AuditRecordError(f"audit record fields {got} != {sorted(names)}")
        try:
            obj["action"] = AuditAction(obj["action"])
        except ValueError as exc:
            raise AuditRecordError(f"unknown audit action {obj['action']!r}") from exc
        return cls(**obj)


_RECORD_NAMES = tuple(f.name for f in fields(AuditRecord))
_BODY_NAMES = tuple(name for name in _RECORD_NAMES if name != "hash")


# json.dumps with these arguments, without building an encoder per call (it keeps no state between calls).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_json(obj: dict[str, object]) -> bytes:
    """Sorted keys, no whitespace, non-ASCII kept as utf-8: one byte string per value."""
    return _CANONICAL.encode(obj).encode("utf-8")


def chain_hash(prev_hash: str, body: bytes) -> str:
    """sha256(bytes.fromhex(prev_hash) || body) as lowercase hex; body is a record's canonical_body()."""
    if len(prev_hash) != 64:
        raise ValueError(f"prev_hash must be 64 hex characters, got {prev_hash!r}")
    return hashlib.sha256(bytes.fromhex(prev_hash) + body).hexdigest()


def seal(event: AuditEvent, *, seq: int, ts_us: int, prev_hash: str) -> AuditRecord:
    """Turn an event into the next record of a chain whose head is (seq - 1, prev_hash)."""
    if seq < 1:
        raise ValueError(f"audit seq starts at 1, got {seq}")
    # The canonical body built straight from the event: the same dict `body_fields()` gives of the
    # record, without building an unsealed record first (every store write seals records).
    body = {
        "seq": seq,
        "ts_us": ts_us,
        "actor": event.actor,
        "action": str(event.action),
        "tenant": event.tenant,
        "subject": event.subject,
        "reason": event.reason,
        "nbytes": event.nbytes,
        "prev_hash": prev_hash,
    }
    return AuditRecord(
        seq=seq,
        ts_us=ts_us,
        actor=event.actor,
        action=event.action,
        tenant=event.tenant,
        subject=event.subject,
        reason=event.reason,
        nbytes=event.nbytes,
        prev_hash=prev_hash,
        hash=chain_hash(prev_hash, canonical_json(body)),
    )


@dataclass(frozen=True, kw_only=True)
class VerifyResult:
    """Outcome of walking a chain. `first_break_seq` is the seq at which the chain first fails (for a
    missing record, the seq that was expected there); None when ok."""

    ok: bool
    records: int
    first_break_seq: int | None = None
    reason: str = ""


def verify_chain(
    records: Iterable[AuditRecord],
    *,
    head: tuple[int, str] | None = None,
) -> VerifyResult:
    """Walk records in stored order and report the first break.

    Checks that seq runs 1, 2, ... without gaps, each prev_hash equals the previous record's hash
    (GENESIS_HASH for seq 1), each hash equals chain_hash(prev_hash, canonical_body()), and, when
    `head` (last seq, last hash) is given, that the chain ends exactly there (so deleting the newest
    records is detected).
    """
    expected_seq = 1
    prev = GENESIS_HASH
    count = 0
    for rec in records:
        count += 1
        if rec.seq != expected_seq:
            why = "record missing or reordered" if rec.seq > expected_seq else "seq repeated or reordered"
            return VerifyResult(ok=False, records=count, first_break_seq=expected_seq, reason=why)
        if rec.prev_hash != prev:
            return VerifyResult(ok=False, records=count, first_break_seq=rec.seq, reason="prev_hash mismatch")
        if chain_hash(rec.prev_hash, rec.canonical_body()) != rec.hash:
            return VerifyResult(ok=False, records=count, first_break_seq=rec.seq, reason="hash mismatch")
        prev = rec.hash
        expected_seq += 1
    if head is not None:
        head_seq, head_hash = head
        if head_seq != expected_seq - 1:
            return VerifyResult(
                ok=False,
                records=count,
                first_break_seq=min(head_seq, expected_seq),
                reason=f"chain ends at seq {expected_seq - 1} but head says {head_seq}",
            )
        if head_seq > 0 and head_hash != prev:
            return VerifyResult(
                ok=False, records=count, first_break_seq=head_seq, reason="head hash mismatch"
            )
    return VerifyResult(ok=True, records=count)


class AuditSink(ABC):
    """Append-only, hash-chained audit log. Implementations: RocksAuditSink here, a SQL sink in
    orchestrator/ (authoritative when the service runs). All use `seal` and `verify_chain`."""

    @abstractmethod
    def append(self, event: AuditEvent) -> AuditRecord:
        """Seal `event` as the next record and persist it durably before returning it."""

    @abstractmethod
    def iter_records(self) -> Iterator[AuditRecord]:
        """Every record in seq order."""

    @abstractmethod
    def head(self) -> tuple[int, str]:
        """(seq, hash) of the newest record, (0, GENESIS_HASH) when empty."""

    def verify(self) -> VerifyResult:
        """Walk the whole chain against the head; report the first break."""
        return verify_chain(self.iter_records(), head=self.head())
