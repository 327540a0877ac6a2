import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResumePath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESUME_PATH_UNSPECIFIED: _ClassVar[ResumePath]
    RESUME_PATH_FULL_HIT: _ClassVar[ResumePath]
    RESUME_PATH_GLOBAL_REPLAY: _ClassVar[ResumePath]
    RESUME_PATH_COLD_PREFILL: _ClassVar[ResumePath]
    RESUME_PATH_MODEL_SWAP: _ClassVar[ResumePath]

class PlanReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_REASON_UNSPECIFIED: _ClassVar[PlanReason]
    PLAN_REASON_NEW_SESSION: _ClassVar[PlanReason]
    PLAN_REASON_WINDOWS_IN_POOL: _ClassVar[PlanReason]
    PLAN_REASON_WINDOWS_REBUILT: _ClassVar[PlanReason]
    PLAN_REASON_NOTHING_USABLE_STORED: _ClassVar[PlanReason]
    PLAN_REASON_COLD_CHEAPER: _ClassVar[PlanReason]
    PLAN_REASON_NO_VALIDATED_MAPPER: _ClassVar[PlanReason]
    PLAN_REASON_NOTHING_STORED_TO_MAP: _ClassVar[PlanReason]
    PLAN_REASON_MAPPED_FROM_LAST_MODEL: _ClassVar[PlanReason]
    PLAN_REASON_WINDOWS_BY_CONTENT: _ClassVar[PlanReason]
    PLAN_REASON_PREFIX_BY_CONTENT: _ClassVar[PlanReason]
    PLAN_REASON_MAPPED_BY_CONTENT: _ClassVar[PlanReason]

class SessionStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATUS_UNSPECIFIED: _ClassVar[SessionStatus]
    SESSION_STATUS_OPEN: _ClassVar[SessionStatus]
    SESSION_STATUS_CLOSED: _ClassVar[SessionStatus]

class RetentionOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETENTION_OUTCOME_UNSPECIFIED: _ClassVar[RetentionOutcome]
    RETENTION_OUTCOME_ACCEPTED: _ClassVar[RetentionOutcome]
    RETENTION_OUTCOME_CLIPPED: _ClassVar[RetentionOutcome]
    RETENTION_OUTCOME_DEFAULTED: _ClassVar[RetentionOutcome]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_TOKEN_OUT_OF_VOCABULARY: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_NOT_SERVED: _ClassVar[ErrorReason]
    ERROR_REASON_MAPPER_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_PERMISSION_DENIED: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_CLOSED: _ClassVar[ErrorReason]
    ERROR_REASON_TURN_RUNNING: _ClassVar[ErrorReason]
    ERROR_REASON_STATE_CHANGED: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_TOO_LARGE: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_LIMIT: _ClassVar[ErrorReason]
    ERROR_REASON_CAPACITY: _ClassVar[ErrorReason]
    ERROR_REASON_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_CANCELLED: _ClassVar[ErrorReason]
    ERROR_REASON_UNIMPLEMENTED: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]
    ERROR_REASON_FIT_JOB_NOT_FOUND: _ClassVar[ErrorReason]
RESUME_PATH_UNSPECIFIED: ResumePath
RESUME_PATH_FULL_HIT: ResumePath
RESUME_PATH_GLOBAL_REPLAY: ResumePath
RESUME_PATH_COLD_PREFILL: ResumePath
RESUME_PATH_MODEL_SWAP: ResumePath
PLAN_REASON_UNSPECIFIED: PlanReason
PLAN_REASON_NEW_SESSION: PlanReason
PLAN_REASON_WINDOWS_IN_POOL: PlanReason
PLAN_REASON_WINDOWS_REBUILT: PlanReason
PLAN_REASON_NOTHING_USABLE_STORED: PlanReason
PLAN_REASON_COLD_CHEAPER: PlanReason
PLAN_REASON_NO_VALIDATED_MAPPER: PlanReason
PLAN_REASON_NOTHING_STORED_TO_MAP: PlanReason
PLAN_REASON_MAPPED_FROM_LAST_MODEL: PlanReason
PLAN_REASON_WINDOWS_BY_CONTENT: PlanReason
PLAN_REASON_PREFIX_BY_CONTENT: PlanReason
PLAN_REASON_MAPPED_BY_CONTENT: PlanReason
SESSION_STATUS_UNSPECIFIED: SessionStatus
SESSION_STATUS_OPEN: SessionStatus
SESSION_STATUS_CLOSED: SessionStatus
RETENTION_OUTCOME_UNSPECIFIED: RetentionOutcome
RETENTION_OUTCOME_ACCEPTED: RetentionOutcome
RETENTION_OUTCOME_CLIPPED: RetentionOutcome
RETENTION_OUTCOME_DEFAULTED: RetentionOutcome
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_TOKEN_OUT_OF_VOCABULARY: ErrorReason
ERROR_REASON_SESSION_NOT_FOUND: ErrorReason
ERROR_REASON_MODEL_NOT_SERVED: ErrorReason
ERROR_REASON_MAPPER_NOT_FOUND: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_PERMISSION_DENIED: ErrorReason
ERROR_REASON_SESSION_CLOSED: ErrorReason
ERROR_REASON_TURN_RUNNING: ErrorReason
ERROR_REASON_STATE_CHANGED: ErrorReason
ERROR_REASON_REQUEST_TOO_LARGE: ErrorReason
ERROR_REASON_SESSION_LIMIT: ErrorReason
ERROR_REASON_CAPACITY: ErrorReason
ERROR_REASON_UNAVAILABLE: ErrorReason
ERROR_REASON_DEADLINE_EXCEEDED: ErrorReason
ERROR_REASON_CANCELLED: ErrorReason
ERROR_REASON_UNIMPLEMENTED: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
ERROR_REASON_FIT_JOB_NOT_FOUND: ErrorReason

class TokenCounts(_message.Message):
    __slots__ = ("cached", "replayed_encoder", "replayed_decoder", "prefilled", "mapped")
    CACHED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_ENCODER_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_DECODER_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    cached: int
    replayed_encoder: int
    replayed_decoder: int
    prefilled: int
    mapped: int
    def __init__(self, cached: _Optional[int] = ..., replayed_encoder: _Optional[int] = ..., replayed_decoder: _Optional[int] = ..., prefilled: _Optional[int] = ..., mapped: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("path", "model", "reason", "counts", "source_model", "mapper_id", "persist", "persist_note", "turn_index", "reason_code", "prompt_tokens")
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MAPPER_ID_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    PERSIST_NOTE_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_CODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    path: ResumePath
    model: str
    reason: str
    counts: TokenCounts
    source_model: str
    mapper_id: str
    persist: bool
    persist_note: str
    turn_index: int
    reason_code: PlanReason
    prompt_tokens: int
    def __init__(self, path: _Optional[_Union[ResumePath, str]] = ..., model: _Optional[str] = ..., reason: _Optional[str] = ..., counts: _Optional[_Union[TokenCounts, _Mapping]] = ..., source_model: _Optional[str] = ..., mapper_id: _Optional[str] = ..., persist: _Optional[bool] = ..., persist_note: _Optional[str] = ..., turn_index: _Optional[int] = ..., reason_code: _Optional[_Union[PlanReason, str]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class RetentionHints(_message.Message):
    __slots__ = ("retention_s",)
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    retention_s: float
    def __init__(self, retention_s: _Optional[float] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "tenant_id", "model", "status", "turn_count", "history_tokens", "retention_s", "parent_session_id", "forked_at_turn", "created_at", "updated_at")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TURN_COUNT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FORKED_AT_TURN_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant_id: str
    model: str
    status: SessionStatus
    turn_count: int
    history_tokens: int
    retention_s: float
    parent_session_id: str
    forked_at_turn: int
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    def __init__(self, session_id: _Optional[str] = ..., tenant_id: _Optional[str] = ..., model: _Optional[str] = ..., status: _Optional[_Union[SessionStatus, str]] = ..., turn_count: _Optional[int] = ..., history_tokens: _Optional[int] = ..., retention_s: _Optional[float] = ..., parent_session_id: _Optional[str] = ..., forked_at_turn: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
