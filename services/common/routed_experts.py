"""The contract's RoutedExperts (MoE routing replay) as arrays: encoded by the rollout, checked by the reward
service, decoded by the trainer. numpy only (the reward service does not load torch)."""

from __future__ import annotations

import numpy as np

from services.common.contracts import data_pb2

INDEX_DTYPE = np.dtype("<u2")  # RoutedExperts.indices: little-endian uint16


def encode(routes: np.ndarray) -> data_pb2.RoutedExperts:
    """Expert indices [positions, layers, top_k] -> the message."""
    assert routes.ndim == 3 and (routes.size == 0 or (routes.min() >= 0 and routes.max() <= np.iinfo(INDEX_DTYPE).max))
    return data_pb2.RoutedExperts(indices=routes.astype(INDEX_DTYPE).tobytes(), layers=routes.shape[1],
                                  top_k=routes.shape[2])


def decode(message: data_pb2.RoutedExperts) -> np.ndarray:
    """The message -> uint16 [positions, layers, top_k]; ValueError naming the field when malformed."""
    if message.layers < 1 or message.top_k < 1:
        raise ValueError(f"routed_experts.layers / top_k: must be >= 1, got {message.layers} / {message.top_k}")
    per_position = INDEX_DTYPE.itemsize * message.layers * message.top_k
    if len(message.indices) % per_position:
        raise ValueError(f"routed_experts.indices: {len(message.indices)} bytes is not a whole number of positions "
                         f"({per_position} bytes each)")
    return np.frombuffer(message.indices, dtype=INDEX_DTYPE).reshape(-1, message.layers, message.top_k)


def check(traj: data_pb2.Trajectory) -> np.ndarray | None:
    """The trajectory's routes if it carries any (None if not); ValueError naming the field when they are
    malformed or cover more positions than the trajectory has tokens."""
    if not traj.HasField("routed_experts"):
        return None
    routes = decode(traj.routed_experts)
    tokens = len(traj.prompt_ids) + len(traj.completion_ids)
    if len(routes) > tokens:
        raise ValueError(f"routed_experts: {len(routes)} positions for {tokens} tokens")
    return routes
