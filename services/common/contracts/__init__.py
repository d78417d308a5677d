"""Generated protobuf / gRPC stubs (run `make proto`) and their short import names."""

from services.common.contracts.meshrl.v1 import (  # noqa: F401
    builder_pb2,
    builder_pb2_grpc,
    common_pb2,
    data_pb2,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weight_exchange_pb2,
    weight_exchange_pb2_grpc,
)
