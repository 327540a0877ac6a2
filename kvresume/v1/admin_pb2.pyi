from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TenantRef(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class RetentionPolicy(_message.Message):
    __slots__ = ("tenant_id", "floor_s", "ceiling_s", "is_default")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    FLOOR_S_FIELD_NUMBER: _ClassVar[int]
    CEILING_S_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    floor_s: float
    ceiling_s: float
    is_default: bool
    def __init__(self, tenant_id: _Optional[str] = ..., floor_s: _Optional[float] = ..., ceiling_s: _Optional[float] = ..., is_default: _Optional[bool] = ...) -> None: ...

class ResidencyPolicy(_message.Message):
    __slots__ = ("tenant_id", "allowed_regions", "is_default", "warning", "node_region")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_REGIONS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    NODE_REGION_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    allowed_regions: _containers.RepeatedScalarFieldContainer[str]
    is_default: bool
    warning: str
    node_region: str
    def __init__(self, tenant_id: _Optional[str] = ..., allowed_regions: _Optional[_Iterable[str]] = ..., is_default: _Optional[bool] = ..., warning: _Optional[str] = ..., node_region: _Optional[str] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("session_id", "tenant_id", "model", "model_tenant_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant_id: str
    model: str
    model_tenant_id: str
    def __init__(self, session_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model: _Optional[str] = ..., model_tenant_id: _Optional[str] = ...) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("sessions_deleted", "segments_deleted", "bytes_deleted")
    SESSIONS_DELETED_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    sessions_deleted: int
    segments_deleted: int
    bytes_deleted: int
    def __init__(self, sessions_deleted: _Optional[int] = ..., segments_deleted: _Optional[int] = ..., bytes_deleted: _Optional[int] = ...) -> None: ...

class QueryAuditRequest(_message.Message):
    __slots__ = ("tenant_id", "action", "since_us", "until_us", "after_seq", "limit", "chain")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SINCE_US_FIELD_NUMBER: _ClassVar[int]
    UNTIL_US_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    action: str
    since_us: int
    until_us: int
    after_seq: int
    limit: int
    chain: str
    def __init__(self, tenant_id: _Optional[str] = ..., action: _Optional[str] = ..., since_us: _Optional[int] = ..., until_us: _Optional[int] = ..., after_seq: _Optional[int] = ..., limit: _Optional[int] = ..., chain: _Optional[str] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("seq", "ts_us", "actor", "action", "tenant", "subject", "reason", "nbytes", "prev_hash", "hash", "chain")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_US_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PREV_HASH_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts_us: int
    actor: str
    action: str
    tenant: str
    subject: str
    reason: str
    nbytes: int
    prev_hash: str
    hash: str
    chain: str
    def __init__(self, seq: _Optional[int] = ..., ts_us: _Optional[int] = ..., actor: _Optional[str] = ..., action: _Optional[str] = ..., tenant: _Optional[str] = ..., subject: _Optional[str] = ..., reason: _Optional[str] = ..., nbytes: _Optional[int] = ..., prev_hash: _Optional[str] = ..., hash: _Optional[str] = ..., chain: _Optional[str] = ...) -> None: ...

class QueryAuditResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[AuditRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[AuditRecord, _Mapping]]] = ...) -> None: ...

class VerifyAuditRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyAuditResponse(_message.Message):
    __slots__ = ("ok", "records", "first_break_seq", "reason", "head_seq", "head_hash", "chains", "first_break_chain", "verdict", "store_chain", "problems", "anchors", "store_records_pending")
    OK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BREAK_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BREAK_CHAIN_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    STORE_CHAIN_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    ANCHORS_FIELD_NUMBER: _ClassVar[int]
    STORE_RECORDS_PENDING_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    records: int
    first_break_seq: int
    reason: str
    head_seq: int
    head_hash: str
    chains: _containers.RepeatedCompositeFieldContainer[AuditChainVerdict]
    first_break_chain: str
    verdict: str
    store_chain: AuditChainVerdict
    problems: _containers.RepeatedScalarFieldContainer[str]
    anchors: int
    store_records_pending: int
    def __init__(self, ok: _Optional[bool] = ..., records: _Optional[int] = ..., first_break_seq: _Optional[int] = ..., reason: _Optional[str] = ..., head_seq: _Optional[int] = ..., head_hash: _Optional[str] = ..., chains: _Optional[_Iterable[_Union[AuditChainVerdict, _Mapping]]] = ..., first_break_chain: _Optional[str] = ..., verdict: _Optional[str] = ..., store_chain: _Optional[_Union[AuditChainVerdict, _Mapping]] = ..., problems: _Optional[_Iterable[str]] = ..., anchors: _Optional[int] = ..., store_records_pending: _Optional[int] = ...) -> None: ...

class AuditChainVerdict(_message.Message):
    __slots__ = ("chain", "ok", "records", "first_break_seq", "reason", "head_seq", "head_hash")
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BREAK_SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEAD_HASH_FIELD_NUMBER: _ClassVar[int]
    chain: str
    ok: bool
    records: int
    first_break_seq: int
    reason: str
    head_seq: int
    head_hash: str
    def __init__(self, chain: _Optional[str] = ..., ok: _Optional[bool] = ..., records: _Optional[int] = ..., first_break_seq: _Optional[int] = ..., reason: _Optional[str] = ..., head_seq: _Optional[int] = ..., head_hash: _Optional[str] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ("tenant_id",)
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    def __init__(self, tenant_id: _Optional[str] = ...) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("tenants", "sessions", "segments", "stored_bytes", "stored_tokens", "pool_bytes_used", "pool_budget_bytes", "pool_entries", "region")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    POOL_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    tenants: int
    sessions: int
    segments: int
    stored_bytes: int
    stored_tokens: int
    pool_bytes_used: int
    pool_budget_bytes: int
    pool_entries: int
    region: str
    def __init__(self, tenants: _Optional[int] = ..., sessions: _Optional[int] = ..., segments: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., stored_tokens: _Optional[int] = ..., pool_bytes_used: _Optional[int] = ..., pool_budget_bytes: _Optional[int] = ..., pool_entries: _Optional[int] = ..., region: _Optional[str] = ...) -> None: ...
