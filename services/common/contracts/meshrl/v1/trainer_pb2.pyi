from services.common.contracts.meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatus(_message.Message):
    __slots__ = ("policy_version", "steps", "paused", "algorithm", "last_metrics", "trajectories_trained", "max_staleness_trained", "dead_letters")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DeadLettersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    steps: int
    paused: bool
    algorithm: str
    last_metrics: _containers.ScalarMap[str, float]
    trajectories_trained: int
    max_staleness_trained: int
    dead_letters: _containers.ScalarMap[str, int]
    def __init__(self, policy_version: _Optional[int] = ..., steps: _Optional[int] = ..., paused: _Optional[bool] = ..., algorithm: _Optional[str] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., trajectories_trained: _Optional[int] = ..., max_staleness_trained: _Optional[int] = ..., dead_letters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...
