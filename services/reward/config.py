"""The reward service's configuration."""

from __future__ import annotations

import dataclasses

from services.common.config import ServiceConfig


@dataclasses.dataclass(kw_only=True)
class RewardConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50052"
    model_path: str = "artifacts/models/tiny-qwen3"  # for the tokenizer that decodes completions
    default_verifier: str = "math"
    concurrency: int = 16
