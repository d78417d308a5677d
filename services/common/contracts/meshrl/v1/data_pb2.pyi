from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_KIND_UNSPECIFIED: _ClassVar[VersionKind]
    VERSION_KIND_TRAINED: _ClassVar[VersionKind]
    VERSION_KIND_DEPLOYED: _ClassVar[VersionKind]
    VERSION_KIND_CHECKPOINT: _ClassVar[VersionKind]
    VERSION_KIND_EVAL: _ClassVar[VersionKind]
    VERSION_KIND_RUN_END: _ClassVar[VersionKind]
    VERSION_KIND_BUDGET: _ClassVar[VersionKind]

class RankRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_ROLE_UNSPECIFIED: _ClassVar[RankRole]
    RANK_ROLE_SENDER: _ClassVar[RankRole]
    RANK_ROLE_RECEIVER: _ClassVar[RankRole]
VERSION_KIND_UNSPECIFIED: VersionKind
VERSION_KIND_TRAINED: VersionKind
VERSION_KIND_DEPLOYED: VersionKind
VERSION_KIND_CHECKPOINT: VersionKind
VERSION_KIND_EVAL: VersionKind
VERSION_KIND_RUN_END: VersionKind
VERSION_KIND_BUDGET: VersionKind
RANK_ROLE_UNSPECIFIED: RankRole
RANK_ROLE_SENDER: RankRole
RANK_ROLE_RECEIVER: RankRole

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "seed", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class PromptWork(_message.Message):
    __slots__ = ("work_id", "task_id", "group_id", "prompt_ids", "group_size", "sampling", "issued_version", "issued_at", "split", "grading", "images")
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ISSUED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    GRADING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    work_id: str
    task_id: str
    group_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    group_size: int
    sampling: SamplingParams
    issued_version: int
    issued_at: float
    split: str
    grading: Grading
    images: _containers.RepeatedCompositeFieldContainer[ImageRef]
    def __init__(self, work_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., issued_version: _Optional[int] = ..., issued_at: _Optional[float] = ..., split: _Optional[str] = ..., grading: _Optional[_Union[Grading, _Mapping]] = ..., images: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ...) -> None: ...

class ImageRef(_message.Message):
    __slots__ = ("sha256", "size")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    size: int
    def __init__(self, sha256: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class Grading(_message.Message):
    __slots__ = ("answer", "question", "verifier", "extract", "verifier_options", "shaping", "rg_entry", "row", "extra", "eval_round", "response", "add_reward")
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    EXTRACT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHAPING_FIELD_NUMBER: _ClassVar[int]
    RG_ENTRY_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROUND_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ADD_REWARD_FIELD_NUMBER: _ClassVar[int]
    answer: str
    question: str
    verifier: str
    extract: str
    verifier_options: bytes
    shaping: _containers.RepeatedCompositeFieldContainer[ShapingTerm]
    rg_entry: bytes
    row: bytes
    extra: bytes
    eval_round: int
    response: str
    add_reward: bool
    def __init__(self, answer: _Optional[str] = ..., question: _Optional[str] = ..., verifier: _Optional[str] = ..., extract: _Optional[str] = ..., verifier_options: _Optional[bytes] = ..., shaping: _Optional[_Iterable[_Union[ShapingTerm, _Mapping]]] = ..., rg_entry: _Optional[bytes] = ..., row: _Optional[bytes] = ..., extra: _Optional[bytes] = ..., eval_round: _Optional[int] = ..., response: _Optional[str] = ..., add_reward: _Optional[bool] = ...) -> None: ...

class ShapingTerm(_message.Message):
    __slots__ = ("name", "options")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    options: bytes
    def __init__(self, name: _Optional[str] = ..., options: _Optional[bytes] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "task_id", "work_id", "group_size", "prompt_ids", "completion_ids", "behavior_logprobs", "versions", "loss_mask", "reward", "scored", "finish_reason", "created_at", "generated_at", "scored_at", "source", "metadata", "split", "verifier", "step_rewards", "sampling", "grading", "routed_experts", "images")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_AT_FIELD_NUMBER: _ClassVar[int]
    SCORED_AT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    STEP_REWARDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GRADING_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    task_id: str
    work_id: str
    group_size: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    scored: bool
    finish_reason: str
    created_at: float
    generated_at: float
    scored_at: float
    source: str
    metadata: bytes
    split: str
    verifier: str
    step_rewards: _containers.RepeatedCompositeFieldContainer[StepReward]
    sampling: SamplingParams
    grading: Grading
    routed_experts: RoutedExperts
    images: _containers.RepeatedCompositeFieldContainer[ImageRef]
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., work_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., scored: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., created_at: _Optional[float] = ..., generated_at: _Optional[float] = ..., scored_at: _Optional[float] = ..., source: _Optional[str] = ..., metadata: _Optional[bytes] = ..., split: _Optional[str] = ..., verifier: _Optional[str] = ..., step_rewards: _Optional[_Iterable[_Union[StepReward, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., grading: _Optional[_Union[Grading, _Mapping]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., images: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "trajectories")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    def __init__(self, group_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ...) -> None: ...

class TrajectoryBundle(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("indices", "layers", "top_k")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    indices: bytes
    layers: int
    top_k: int
    def __init__(self, indices: _Optional[bytes] = ..., layers: _Optional[int] = ..., top_k: _Optional[int] = ...) -> None: ...

class StepReward(_message.Message):
    __slots__ = ("end", "reward")
    END_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    end: int
    reward: float
    def __init__(self, end: _Optional[int] = ..., reward: _Optional[float] = ...) -> None: ...

class TrainingBatch(_message.Message):
    __slots__ = ("batch_id", "index", "trajectories", "created_at", "dropped_stale", "group_ids", "object_name")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_NAME_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    index: int
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    created_at: float
    dropped_stale: int
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    object_name: str
    def __init__(self, batch_id: _Optional[str] = ..., index: _Optional[int] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., created_at: _Optional[float] = ..., dropped_stale: _Optional[int] = ..., group_ids: _Optional[_Iterable[str]] = ..., object_name: _Optional[str] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("event_id", "version", "kind", "at", "checkpoint_path", "metrics", "budget")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    version: int
    kind: VersionKind
    at: float
    checkpoint_path: str
    metrics: _containers.ScalarMap[str, float]
    budget: OnlineBudget
    def __init__(self, event_id: _Optional[str] = ..., version: _Optional[int] = ..., kind: _Optional[_Union[VersionKind, str]] = ..., at: _Optional[float] = ..., checkpoint_path: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., budget: _Optional[_Union[OnlineBudget, _Mapping]] = ...) -> None: ...

class OnlineBudget(_message.Message):
    __slots__ = ("limit_groups", "released_groups", "arrived_groups", "eta", "batch_size")
    LIMIT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    limit_groups: int
    released_groups: int
    arrived_groups: int
    eta: int
    batch_size: int
    def __init__(self, limit_groups: _Optional[int] = ..., released_groups: _Optional[int] = ..., arrived_groups: _Optional[int] = ..., eta: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class TensorRegion(_message.Message):
    __slots__ = ("offsets", "sizes")
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("canonical_name", "canonical_shape", "dtype", "canonical_region", "local_name", "local_shape", "local_region")
    CANONICAL_NAME_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_REGION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_REGION_FIELD_NUMBER: _ClassVar[int]
    canonical_name: str
    canonical_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    canonical_region: TensorRegion
    local_name: str
    local_shape: _containers.RepeatedScalarFieldContainer[int]
    local_region: TensorRegion
    def __init__(self, canonical_name: _Optional[str] = ..., canonical_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., canonical_region: _Optional[_Union[TensorRegion, _Mapping]] = ..., local_name: _Optional[str] = ..., local_shape: _Optional[_Iterable[int]] = ..., local_region: _Optional[_Union[TensorRegion, _Mapping]] = ...) -> None: ...

class RankLayout(_message.Message):
    __slots__ = ("rank_id", "role", "framework", "parallel", "shards", "agent_address", "endpoints", "host", "version")
    class ParallelEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class EndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    role: RankRole
    framework: str
    parallel: _containers.ScalarMap[str, int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardSpec]
    agent_address: str
    endpoints: _containers.ScalarMap[str, str]
    host: str
    version: int
    def __init__(self, rank_id: _Optional[str] = ..., role: _Optional[_Union[RankRole, str]] = ..., framework: _Optional[str] = ..., parallel: _Optional[_Mapping[str, int]] = ..., shards: _Optional[_Iterable[_Union[ShardSpec, _Mapping]]] = ..., agent_address: _Optional[str] = ..., endpoints: _Optional[_Mapping[str, str]] = ..., host: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("subject", "consumer", "reason", "data", "at", "type")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    subject: str
    consumer: str
    reason: str
    data: bytes
    at: float
    type: str
    def __init__(self, subject: _Optional[str] = ..., consumer: _Optional[str] = ..., reason: _Optional[str] = ..., data: _Optional[bytes] = ..., at: _Optional[float] = ..., type: _Optional[str] = ...) -> None: ...
