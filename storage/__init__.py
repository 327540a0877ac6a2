"""Bytes on disk and in RAM: RocksDB global-KV store, window pool, retention, residency, audit log.

Knows nothing of tensors (never imports torch); the cache format belongs to model/.
"""

from storage.audit_record import (
    GENESIS_HASH,
    AuditAction,
    AuditEvent,
    AuditRecord,
    AuditSink,
    VerifyResult,
    canonical_json,
    chain_hash,
    seal,
    verify_chain,
)
from storage.audit_rocks import RocksAuditSink
from storage.errors import AuditRecordError, StorageError, StoreClosedError, StoreFormatError

__all__ = [
    "GENESIS_HASH",
    "AuditAction",
    "AuditEvent",
    "AuditRecord",
    "AuditRecordError",
    "AuditSink",
    "RocksAuditSink",
    "StorageError",
    "StoreClosedError",
    "StoreFormatError",
    "VerifyResult",
    "canonical_json",
    "chain_hash",
    "seal",
    "verify_chain",
]
