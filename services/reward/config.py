"""The reward service's configuration."""

from __future__ import annotations

import dataclasses

from services.common.config import ServiceConfig
from services.common.errors import FieldError
from services.reward.sandbox import SandboxConfig
from services.reward.verifiers.judge import JudgeConfig
from services.reward.verifiers.pool import VerifierPool


@dataclasses.dataclass(kw_only=True)
class PoolConfig:
    """Worker processes for the slow verifiers (math-verify, reasoning-gym scorers, plugins)."""

    workers: int = 2
    timeout_s: float = 10.0  # a verification past it scores 0 with the reason "timeout"

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise FieldError("workers", f"must be >= 1, got {self.workers}")
        if not self.timeout_s > 0:
            raise FieldError("timeout_s", f"must be > 0, got {self.timeout_s}")

    def build(self) -> VerifierPool:
        return VerifierPool(self.workers)


@dataclasses.dataclass(kw_only=True)
class RewardConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50052"
    model_path: str = "artifacts/models/tiny-qwen3"  # for the tokenizer that decodes completions
    default_verifier: str = "math"  # for trajectories whose grading names no verifier
    concurrency: int = 16
    verifier_pool: PoolConfig = dataclasses.field(default_factory=PoolConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)  # code verifiers' bwrap sandbox
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)  # the llm_judge verifier's endpoint
