"""The trainer service's configuration."""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common.config import ServiceConfig
from services.trainer.step import OptimConfig


@dataclasses.dataclass(kw_only=True)
class TrainerConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50054"
    rank_id: str = "trainer-0"
    model_path: str = "artifacts/models/tiny-qwen3"
    algo: str = "grpo"                                   # preset name (python -m services.trainer.algorithms --list)
    algo_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    temperature: float = 1.0                            # the rollout's sampling temperature
    total_steps: int = 0                                # final checkpoint after this many steps; 0 = unbounded
    checkpoint_every: int = 0                           # steps between checkpoints; 0 = only the final one
    seed: int = 0
    torch_threads: int = 1
    wx_address: str = "127.0.0.1:50055"                 # weight_exchange; empty: no weight sync
    weight_transport: str = "shm"
    sync_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.total_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("total_steps / checkpoint_every: must be >= 0")
