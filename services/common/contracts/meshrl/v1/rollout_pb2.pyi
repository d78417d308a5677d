from services.common.contracts.meshrl.v1 import common_pb2 as _common_pb2
from services.common.contracts.meshrl.v1 import data_pb2 as _data_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "n")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _data_pb2.SamplingParams
    n: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_data_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "versions", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("policy_version", "paused", "running_sequences", "waiting_sequences", "trajectories_published", "tokens_generated", "weight_updates", "interrupted_sequences", "engine", "dead_letters", "prefix_cache_lookup_tokens", "prefix_cache_hit_tokens")
    class DeadLettersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    paused: bool
    running_sequences: int
    waiting_sequences: int
    trajectories_published: int
    tokens_generated: int
    weight_updates: int
    interrupted_sequences: int
    engine: str
    dead_letters: _containers.ScalarMap[str, int]
    prefix_cache_lookup_tokens: int
    prefix_cache_hit_tokens: int
    def __init__(self, policy_version: _Optional[int] = ..., paused: _Optional[bool] = ..., running_sequences: _Optional[int] = ..., waiting_sequences: _Optional[int] = ..., trajectories_published: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., weight_updates: _Optional[int] = ..., interrupted_sequences: _Optional[int] = ..., engine: _Optional[str] = ..., dead_letters: _Optional[_Mapping[str, int]] = ..., prefix_cache_lookup_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ...) -> None: ...
