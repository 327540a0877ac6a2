import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
