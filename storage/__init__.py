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
from storage.audit_rocks import RocksAuditSink, read_only_audit
from storage.chunk_key import token_bytes
from storage.errors import (
    AuditRecordError,
    StorageError,
    StoreClosedError,
    StoreDamagedError,
    StoreFormatError,
    StoreLockedError,
    StoreVersionError,
)
from storage.kv_store import GlobalKVStore
from storage.policy import DEFAULT_CEILING_S, DEFAULT_FLOOR_S, RetentionPolicy
from storage.prefix_index import (
    ContentKey,
    PrefixIndex,
    history_digest,
    longest_prefix_by_scan,
    prefix_digests,
)
from storage.quarantine import QuarantineArea, QuarantinedStore
from storage.store_config import StoreConfig
from storage.store_health import HealthReason, StoreHealth
from storage.store_open import (
    CheckStatus,
    StoreCheck,
    StoreRepair,
    check_store,
    open_store,
    refuse_newer_format,
    repair_store,
)
from storage.store_results import (
    ChunkSpan,
    IndexedPrefix,
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
    "CheckStatus",
    "ChunkSpan",
    "ContentKey",
    "GlobalKVStore",
    "HealthReason",
    "IndexedPrefix",
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
    "QuarantineArea",
    "QuarantinedStore",
    "RecoveryReport",
    "Refusal",
    "RefusalKind",
    "RetentionPolicy",
    "RocksAuditSink",
    "StorageError",
    "StoreCheck",
    "StoreClosedError",
    "StoreConfig",
    "StoreDamagedError",
    "StoreFormatError",
    "StoreHealth",
    "StoreLockedError",
    "StoreRepair",
    "StoreStats",
    "StoreVersionError",
    "TenantStats",
    "VerifyResult",
    "WindowPool",
    "canonical_json",
    "chain_hash",
    "check_store",
    "history_digest",
    "longest_prefix_by_scan",
    "open_store",
    "refuse_newer_format",
    "prefix_digests",
    "read_only_audit",
    "repair_store",
    "seal",
    "token_bytes",
    "verify_chain",
]
