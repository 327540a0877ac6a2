from kvresume.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORTED: FinishReason

class CreateSessionRequest(_message.Message):
    __slots__ = ("model", "retention")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    retention: _common_pb2.RetentionHints
    def __init__(self, model: _Optional[str] = ..., retention: _Optional[_Union[_common_pb2.RetentionHints, _Mapping]] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session", "retention_outcome", "requested_retention_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RETENTION_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.Session
    retention_outcome: _common_pb2.RetentionOutcome
    requested_retention_s: float
    def __init__(self, session: _Optional[_Union[_common_pb2.Session, _Mapping]] = ..., retention_outcome: _Optional[_Union[_common_pb2.RetentionOutcome, str]] = ..., requested_retention_s: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "text", "generation", "model", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: TokenIds
    text: str
    generation: GenerationParams
    model: str
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., generation: _Optional[_Union[GenerationParams, _Mapping]] = ..., model: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("ids", "text")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class TurnStats(_message.Message):
    __slots__ = ("turn_index", "ttft_s", "decode_tokens_per_s", "counts", "generated_tokens", "finish_reason", "total_s", "persisted", "prompt_tokens", "stored_tokens", "kept", "request_id")
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    turn_index: int
    ttft_s: float
    decode_tokens_per_s: float
    counts: _common_pb2.TokenCounts
    generated_tokens: int
    finish_reason: FinishReason
    total_s: float
    persisted: bool
    prompt_tokens: int
    stored_tokens: int
    kept: bool
    request_id: str
    def __init__(self, turn_index: _Optional[int] = ..., ttft_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., counts: _Optional[_Union[_common_pb2.TokenCounts, _Mapping]] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., total_s: _Optional[float] = ..., persisted: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., stored_tokens: _Optional[int] = ..., kept: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class TurnEvent(_message.Message):
    __slots__ = ("plan", "tokens", "stats")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.Plan
    tokens: TokenChunk
    stats: TurnStats
    def __init__(self, plan: _Optional[_Union[_common_pb2.Plan, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., stats: _Optional[_Union[TurnStats, _Mapping]] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "at_turn")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    AT_TURN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    at_turn: int
    def __init__(self, session_id: _Optional[str] = ..., at_turn: _Optional[int] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: _common_pb2.Session
    def __init__(self, session: _Optional[_Union[_common_pb2.Session, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "open_only")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OPEN_ONLY_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    open_only: bool
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., open_only: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Session]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[_common_pb2.Session, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("segments_deleted", "bytes_deleted")
    SEGMENTS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DELETED_FIELD_NUMBER: _ClassVar[int]
    segments_deleted: int
    bytes_deleted: int
    def __init__(self, segments_deleted: _Optional[int] = ..., bytes_deleted: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "reason", "request_id", "keep_partial")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    request_id: str
    keep_partial: bool
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ..., request_id: _Optional[str] = ..., keep_partial: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted", "session_id", "request_id")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    session_id: str
    request_id: str
    def __init__(self, aborted: _Optional[bool] = ..., session_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...
