"""The rollout service's configuration."""

from __future__ import annotations

import dataclasses
import os

from services.common.config import ServiceConfig
from services.rollout.engines.torch_engine import EngineConfig
from services.rollout.gateway.config import GatewayConfig


def default_rank_id() -> str:
    """Unique per replica in a container (Compose and Kubernetes set HOSTNAME to the container or pod name)."""
    host = os.environ.get("HOSTNAME", "")
    return f"rollout-{host}" if host else "rollout-0"


@dataclasses.dataclass(kw_only=True)
class RolloutConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50051"
    rank_id: str = dataclasses.field(default_factory=default_rank_id)  # the weight exchange's name for this rank
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    concurrency: int = 64  # prompt-work messages generated at once
    wx_address: str = "127.0.0.1:50055"  # weight_exchange; empty: no weight updates
    catch_up_timeout: float = 120.0  # at start, wait this long for the trainer's weights before generating anyway
    gateway_enabled: bool = False  # serve the OpenAI / Anthropic agent gateway (make up turns it on)
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.catch_up_timeout <= 0:
            raise ValueError(f"catch_up_timeout: must be positive, got {self.catch_up_timeout}")
