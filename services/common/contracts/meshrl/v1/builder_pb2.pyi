from services.common.contracts.meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class BuilderStatus(_message.Message):
    __slots__ = ("policy_version", "max_staleness", "batch_size", "groups_issued", "groups_in_flight", "groups_accepted", "batches_published", "trajectories_received", "trajectories_dropped_stale", "capacity", "paused", "mean_reward", "dead_lettered", "dead_letters", "groups_dropped", "groups_filtered", "extra_prompts_issued")
    class DeadLettersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ISSUED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_PROMPTS_ISSUED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    max_staleness: int
    batch_size: int
    groups_issued: int
    groups_in_flight: int
    groups_accepted: int
    batches_published: int
    trajectories_received: int
    trajectories_dropped_stale: int
    capacity: int
    paused: bool
    mean_reward: float
    dead_lettered: int
    dead_letters: _containers.ScalarMap[str, int]
    groups_dropped: int
    groups_filtered: int
    extra_prompts_issued: int
    def __init__(self, policy_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., batch_size: _Optional[int] = ..., groups_issued: _Optional[int] = ..., groups_in_flight: _Optional[int] = ..., groups_accepted: _Optional[int] = ..., batches_published: _Optional[int] = ..., trajectories_received: _Optional[int] = ..., trajectories_dropped_stale: _Optional[int] = ..., capacity: _Optional[int] = ..., paused: _Optional[bool] = ..., mean_reward: _Optional[float] = ..., dead_lettered: _Optional[int] = ..., dead_letters: _Optional[_Mapping[str, int]] = ..., groups_dropped: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., extra_prompts_issued: _Optional[int] = ...) -> None: ...
