import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FitJobPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIT_JOB_PHASE_UNSPECIFIED: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_QUEUED: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_RUNNING: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_EVALUATING: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_SUCCEEDED: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_REJECTED: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_FAILED: _ClassVar[FitJobPhase]
    FIT_JOB_PHASE_CANCELLED: _ClassVar[FitJobPhase]
FIT_JOB_PHASE_UNSPECIFIED: FitJobPhase
FIT_JOB_PHASE_QUEUED: FitJobPhase
FIT_JOB_PHASE_RUNNING: FitJobPhase
FIT_JOB_PHASE_EVALUATING: FitJobPhase
FIT_JOB_PHASE_SUCCEEDED: FitJobPhase
FIT_JOB_PHASE_REJECTED: FitJobPhase
FIT_JOB_PHASE_FAILED: FitJobPhase
FIT_JOB_PHASE_CANCELLED: FitJobPhase

class Mapper(_message.Message):
    __slots__ = ("mapper_id", "sender_model", "receiver_model", "artifact_uri", "artifact_sha256", "kind", "metrics", "gate_metric", "gate_threshold", "passed_gate", "created_at")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MAPPER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_MODEL_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_MODEL_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    GATE_METRIC_FIELD_NUMBER: _ClassVar[int]
    GATE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    PASSED_GATE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    mapper_id: str
    sender_model: str
    receiver_model: str
    artifact_uri: str
    artifact_sha256: str
    kind: str
    metrics: _containers.ScalarMap[str, float]
    gate_metric: str
    gate_threshold: float
    passed_gate: bool
    created_at: _timestamp_pb2.Timestamp
    def __init__(self, mapper_id: _Optional[str] = ..., sender_model: _Optional[str] = ..., receiver_model: _Optional[str] = ..., artifact_uri: _Optional[str] = ..., artifact_sha256: _Optional[str] = ..., kind: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., gate_metric: _Optional[str] = ..., gate_threshold: _Optional[float] = ..., passed_gate: _Optional[bool] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RegisterMapperRequest(_message.Message):
    __slots__ = ("mapper",)
    MAPPER_FIELD_NUMBER: _ClassVar[int]
    mapper: Mapper
    def __init__(self, mapper: _Optional[_Union[Mapper, _Mapping]] = ...) -> None: ...

class ListMappersRequest(_message.Message):
    __slots__ = ("sender_model", "receiver_model")
    SENDER_MODEL_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_MODEL_FIELD_NUMBER: _ClassVar[int]
    sender_model: str
    receiver_model: str
    def __init__(self, sender_model: _Optional[str] = ..., receiver_model: _Optional[str] = ...) -> None: ...

class ListMappersResponse(_message.Message):
    __slots__ = ("mappers",)
    MAPPERS_FIELD_NUMBER: _ClassVar[int]
    mappers: _containers.RepeatedCompositeFieldContainer[Mapper]
    def __init__(self, mappers: _Optional[_Iterable[_Union[Mapper, _Mapping]]] = ...) -> None: ...

class GetMapperRequest(_message.Message):
    __slots__ = ("mapper_id",)
    MAPPER_ID_FIELD_NUMBER: _ClassVar[int]
    mapper_id: str
    def __init__(self, mapper_id: _Optional[str] = ...) -> None: ...

class CalibrationCorpus(_message.Message):
    __slots__ = ("name", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    seed: int
    def __init__(self, name: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class CalibrationSource(_message.Message):
    __slots__ = ("corpus", "tokens_file")
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FILE_FIELD_NUMBER: _ClassVar[int]
    corpus: CalibrationCorpus
    tokens_file: str
    def __init__(self, corpus: _Optional[_Union[CalibrationCorpus, _Mapping]] = ..., tokens_file: _Optional[str] = ...) -> None: ...

class FitGate(_message.Message):
    __slots__ = ("min_attn_cosine", "max_next_token_kl", "min_index_recall", "min_retention", "task_episodes", "eval_prompts", "min_retention_lower", "disabled", "task_seed")
    MIN_ATTN_COSINE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEXT_TOKEN_KL_FIELD_NUMBER: _ClassVar[int]
    MIN_INDEX_RECALL_FIELD_NUMBER: _ClassVar[int]
    MIN_RETENTION_FIELD_NUMBER: _ClassVar[int]
    TASK_EPISODES_FIELD_NUMBER: _ClassVar[int]
    EVAL_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MIN_RETENTION_LOWER_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    TASK_SEED_FIELD_NUMBER: _ClassVar[int]
    min_attn_cosine: float
    max_next_token_kl: float
    min_index_recall: float
    min_retention: float
    task_episodes: int
    eval_prompts: int
    min_retention_lower: float
    disabled: _containers.RepeatedScalarFieldContainer[str]
    task_seed: int
    def __init__(self, min_attn_cosine: _Optional[float] = ..., max_next_token_kl: _Optional[float] = ..., min_index_recall: _Optional[float] = ..., min_retention: _Optional[float] = ..., task_episodes: _Optional[int] = ..., eval_prompts: _Optional[int] = ..., min_retention_lower: _Optional[float] = ..., disabled: _Optional[_Iterable[str]] = ..., task_seed: _Optional[int] = ...) -> None: ...

class StartFitRequest(_message.Message):
    __slots__ = ("sender_model", "receiver_model", "source", "budget_tokens", "sequence_tokens", "gate", "resubmit_job_id", "fallback", "attention_weighted")
    SENDER_MODEL_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    RESUBMIT_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    sender_model: str
    receiver_model: str
    source: CalibrationSource
    budget_tokens: int
    sequence_tokens: int
    gate: FitGate
    resubmit_job_id: str
    fallback: str
    attention_weighted: bool
    def __init__(self, sender_model: _Optional[str] = ..., receiver_model: _Optional[str] = ..., source: _Optional[_Union[CalibrationSource, _Mapping]] = ..., budget_tokens: _Optional[int] = ..., sequence_tokens: _Optional[int] = ..., gate: _Optional[_Union[FitGate, _Mapping]] = ..., resubmit_job_id: _Optional[str] = ..., fallback: _Optional[str] = ..., attention_weighted: _Optional[bool] = ...) -> None: ...

class FitJob(_message.Message):
    __slots__ = ("job_id", "phase", "sender_model", "receiver_model", "source", "budget_tokens", "sequence_tokens", "gate", "rows_done", "rows_total", "eta_s", "reason", "metrics", "passed_gate", "mapper_id", "artifact_uri", "resubmitted_from", "node", "created_at", "started_at", "finished_at", "fallback", "attention_weighted")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SENDER_MODEL_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    ROWS_DONE_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PASSED_GATE_FIELD_NUMBER: _ClassVar[int]
    MAPPER_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_URI_FIELD_NUMBER: _ClassVar[int]
    RESUBMITTED_FROM_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: FitJobPhase
    sender_model: str
    receiver_model: str
    source: CalibrationSource
    budget_tokens: int
    sequence_tokens: int
    gate: FitGate
    rows_done: int
    rows_total: int
    eta_s: float
    reason: str
    metrics: _containers.ScalarMap[str, float]
    passed_gate: bool
    mapper_id: str
    artifact_uri: str
    resubmitted_from: str
    node: str
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    fallback: str
    attention_weighted: bool
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[_Union[FitJobPhase, str]] = ..., sender_model: _Optional[str] = ..., receiver_model: _Optional[str] = ..., source: _Optional[_Union[CalibrationSource, _Mapping]] = ..., budget_tokens: _Optional[int] = ..., sequence_tokens: _Optional[int] = ..., gate: _Optional[_Union[FitGate, _Mapping]] = ..., rows_done: _Optional[int] = ..., rows_total: _Optional[int] = ..., eta_s: _Optional[float] = ..., reason: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., passed_gate: _Optional[bool] = ..., mapper_id: _Optional[str] = ..., artifact_uri: _Optional[str] = ..., resubmitted_from: _Optional[str] = ..., node: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., fallback: _Optional[str] = ..., attention_weighted: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[FitJob]
    def __init__(self, jobs: _Optional[_Iterable[_Union[FitJob, _Mapping]]] = ...) -> None: ...
