"""Bytes on disk and in RAM: RocksDB global-KV store, window pool, retention, residency, audit log.

Knows nothing of tensors (never imports torch); the cache format belongs to model/.
"""

from storage.audit_anchor import (
    Anchor,
    AnchorFile,
    AnchorKey,
    check_anchor_chain,
    check_claims,
    seal_anchor,
)
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
from storage.kv_store import GlobalKVStore
from storage.policy import DEFAULT_CEILING_S, DEFAULT_FLOOR_S, RetentionPolicy
from storage.prefix_index import (
    ContentKey,
    PrefixIndex,
    history_digest,
    longest_prefix_by_scan,
    prefix_digests,
)
from storage.store_config import StoreConfig
from storage.store_results import (
    ChunkSpan,
    LookupResult,
    MaintenanceReport,
    Miss,
    MissReason,
    PrefixResult,
    PurgeResult,
    PutResult,
    RecoveryReport,
    Refusal,
    RefusalKind,
    StoreStats,
    TenantStats,
)
from storage.window_pool import PoolConfig, PoolMiss, PoolPut, PoolStats, PrefixMatch, WindowPool

__all__ = [
    "Anchor",
    "AnchorFile",
    "AnchorKey",
    "check_anchor_chain",
    "check_claims",
    "seal_anchor",
    "DEFAULT_CEILING_S",
    "DEFAULT_FLOOR_S",
    "GENESIS_HASH",
    "AuditAction",
    "AuditEvent",
    "AuditRecord",
    "AuditRecordError",
    "AuditSink",
    "ChunkSpan",
    "ContentKey",
    "GlobalKVStore",
    "LookupResult",
    "MaintenanceReport",
    "Miss",
    "MissReason",
    "PoolConfig",
    "PoolMiss",
    "PoolPut",
    "PoolStats",
    "PrefixIndex",
    "PrefixMatch",
    "PrefixResult",
    "PurgeResult",
    "PutResult",
    "RecoveryReport",
    "Refusal",
    "RefusalKind",
    "RetentionPolicy",
    "RocksAuditSink",
    "StorageError",
    "StoreClosedError",
    "StoreConfig",
    "StoreFormatError",
    "StoreStats",
    "TenantStats",
    "VerifyResult",
    "WindowPool",
    "canonical_json",
    "chain_hash",
    "history_digest",
    "longest_prefix_by_scan",
    "prefix_digests",
    "seal",
    "verify_chain",
]
