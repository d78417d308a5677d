from services.common.contracts.meshrl.v1 import common_pb2 as _common_pb2
from services.common.contracts.meshrl.v1 import data_pb2 as _data_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("verifier", "response", "grading")
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GRADING_FIELD_NUMBER: _ClassVar[int]
    verifier: str
    response: str
    grading: _data_pb2.Grading
    def __init__(self, verifier: _Optional[str] = ..., response: _Optional[str] = ..., grading: _Optional[_Union[_data_pb2.Grading, _Mapping]] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("reward", "detail")
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reward: float
    detail: str
    def __init__(self, reward: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class RunCodeRequest(_message.Message):
    __slots__ = ("code", "language", "stdin", "timeout_s")
    CODE_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    code: str
    language: str
    stdin: bytes
    timeout_s: float
    def __init__(self, code: _Optional[str] = ..., language: _Optional[str] = ..., stdin: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RunCodeReply(_message.Message):
    __slots__ = ("status", "exit_code", "stdout", "stderr", "wall_seconds", "truncated")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    status: str
    exit_code: int
    stdout: str
    stderr: str
    wall_seconds: float
    truncated: bool
    def __init__(self, status: _Optional[str] = ..., exit_code: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., wall_seconds: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ListVerifiersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVerifiersReply(_message.Message):
    __slots__ = ("verifiers",)
    VERIFIERS_FIELD_NUMBER: _ClassVar[int]
    verifiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, verifiers: _Optional[_Iterable[str]] = ...) -> None: ...

class RewardStatus(_message.Message):
    __slots__ = ("scored", "dead_lettered", "mean_reward", "dead_letters")
    class DeadLettersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SCORED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    scored: int
    dead_lettered: int
    mean_reward: float
    dead_letters: _containers.ScalarMap[str, int]
    def __init__(self, scored: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., mean_reward: _Optional[float] = ..., dead_letters: _Optional[_Mapping[str, int]] = ...) -> None: ...
