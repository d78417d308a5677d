from services.common.contracts.meshrl.v1 import common_pb2 as _common_pb2
from services.common.contracts.meshrl.v1 import data_pb2 as _data_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("layout", "rank_key")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANK_KEY_FIELD_NUMBER: _ClassVar[int]
    layout: _data_pb2.RankLayout
    rank_key: str
    def __init__(self, layout: _Optional[_Union[_data_pb2.RankLayout, _Mapping]] = ..., rank_key: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("rank_id", "num_senders", "num_receivers", "sender_version")
    RANK_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SENDERS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    SENDER_VERSION_FIELD_NUMBER: _ClassVar[int]
    rank_id: str
    num_senders: int
    num_receivers: int
    sender_version: int
    def __init__(self, rank_id: _Optional[str] = ..., num_senders: _Optional[int] = ..., num_receivers: _Optional[int] = ..., sender_version: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("transport", "include_transfers")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    include_transfers: bool
    def __init__(self, transport: _Optional[str] = ..., include_transfers: _Optional[bool] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("src_rank_id", "dst_rank_id", "canonical_name", "src_local_name", "src_region", "dst_local_name", "dst_region", "num_bytes", "bucket", "dtype")
    SRC_RANK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_ID_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_REGION_FIELD_NUMBER: _ClassVar[int]
    DST_LOCAL_NAME_FIELD_NUMBER: _ClassVar[int]
    DST_REGION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    src_rank_id: str
    dst_rank_id: str
    canonical_name: str
    src_local_name: str
    src_region: _data_pb2.TensorRegion
    dst_local_name: str
    dst_region: _data_pb2.TensorRegion
    num_bytes: int
    bucket: int
    dtype: str
    def __init__(self, src_rank_id: _Optional[str] = ..., dst_rank_id: _Optional[str] = ..., canonical_name: _Optional[str] = ..., src_local_name: _Optional[str] = ..., src_region: _Optional[_Union[_data_pb2.TensorRegion, _Mapping]] = ..., dst_local_name: _Optional[str] = ..., dst_region: _Optional[_Union[_data_pb2.TensorRegion, _Mapping]] = ..., num_bytes: _Optional[int] = ..., bucket: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("total_bytes", "max_bytes_per_link", "max_bytes_per_rank", "num_messages", "num_buckets", "num_links", "bytes_min")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_LINK_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NUM_LINKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MIN_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    max_bytes_per_link: int
    max_bytes_per_rank: int
    num_messages: int
    num_buckets: int
    num_links: int
    bytes_min: int
    def __init__(self, total_bytes: _Optional[int] = ..., max_bytes_per_link: _Optional[int] = ..., max_bytes_per_rank: _Optional[int] = ..., num_messages: _Optional[int] = ..., num_buckets: _Optional[int] = ..., num_links: _Optional[int] = ..., bytes_min: _Optional[int] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("transfers", "stats", "plan_hash")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    stats: PlanStats
    plan_hash: str
    def __init__(self, transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ..., plan_hash: _Optional[str] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("version", "transport", "verify")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    version: int
    transport: str
    verify: bool
    def __init__(self, version: _Optional[int] = ..., transport: _Optional[str] = ..., verify: _Optional[bool] = ...) -> None: ...

class SyncReply(_message.Message):
    __slots__ = ("version", "seconds", "bytes_moved", "num_receivers", "plan_hash", "delta", "bytes_full")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    version: int
    seconds: float
    bytes_moved: int
    num_receivers: int
    plan_hash: str
    delta: bool
    bytes_full: int
    def __init__(self, version: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes_moved: _Optional[int] = ..., num_receivers: _Optional[int] = ..., plan_hash: _Optional[str] = ..., delta: _Optional[bool] = ..., bytes_full: _Optional[int] = ...) -> None: ...

class WeightExchangeStatus(_message.Message):
    __slots__ = ("num_senders", "num_receivers", "deployed_version", "syncs", "last_sync_seconds", "last_bytes_moved")
    NUM_SENDERS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    DEPLOYED_VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNCS_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    num_senders: int
    num_receivers: int
    deployed_version: int
    syncs: int
    last_sync_seconds: float
    last_bytes_moved: int
    def __init__(self, num_senders: _Optional[int] = ..., num_receivers: _Optional[int] = ..., deployed_version: _Optional[int] = ..., syncs: _Optional[int] = ..., last_sync_seconds: _Optional[float] = ..., last_bytes_moved: _Optional[int] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("version", "transport", "transfers", "sender_endpoints", "timeout_seconds", "verify", "plan_hash", "sync_id", "sender_tickets", "signature", "delta", "delta_base_version", "track_delta")
    class SenderEndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SenderTicketsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    SENDER_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    PLAN_HASH_FIELD_NUMBER: _ClassVar[int]
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_TICKETS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRACK_DELTA_FIELD_NUMBER: _ClassVar[int]
    version: int
    transport: str
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    sender_endpoints: _containers.ScalarMap[str, str]
    timeout_seconds: float
    verify: bool
    plan_hash: str
    sync_id: str
    sender_tickets: _containers.ScalarMap[str, str]
    signature: str
    delta: bool
    delta_base_version: int
    track_delta: bool
    def __init__(self, version: _Optional[int] = ..., transport: _Optional[str] = ..., transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., sender_endpoints: _Optional[_Mapping[str, str]] = ..., timeout_seconds: _Optional[float] = ..., verify: _Optional[bool] = ..., plan_hash: _Optional[str] = ..., sync_id: _Optional[str] = ..., sender_tickets: _Optional[_Mapping[str, str]] = ..., signature: _Optional[str] = ..., delta: _Optional[bool] = ..., delta_base_version: _Optional[int] = ..., track_delta: _Optional[bool] = ...) -> None: ...

class ApplyReply(_message.Message):
    __slots__ = ("bytes_received", "seconds", "checksum", "bytes_full")
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    seconds: float
    checksum: str
    bytes_full: int
    def __init__(self, bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ..., checksum: _Optional[str] = ..., bytes_full: _Optional[int] = ...) -> None: ...
