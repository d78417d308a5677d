"""The trainer service's configuration."""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common.config import ServiceConfig
from services.trainer.algorithms import PRESETS, Algorithm, AlgorithmConfig
from services.trainer.critic import CriticConfig
from services.trainer.lora import LoraConfig
from services.trainer.optim import OptimConfig
from services.trainer.reference import ReferenceConfig

# Run configs switch dynamic sampling on for the online presets; an offline objective selects its own
# samples (DPO skips tied groups, which is what dynamic sampling would drop), so there it is ignored.
_IGNORED_OFFLINE = ("dynamic_sampling",)


@dataclasses.dataclass(kw_only=True)
class TrainerConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50054"
    rank_id: str = "trainer-0"
    model_path: str = "artifacts/models/tiny-qwen3"
    algo: str = "grpo"                                   # preset name (python -m services.trainer.algorithms --list)
    algo_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)          # built when the preset needs one
    reference: ReferenceConfig = dataclasses.field(default_factory=ReferenceConfig)  # built when the preset needs one
    max_new_tokens: int = 8                             # the rollout's generation limit (builder sampling)
    sft_min_reward: float = 0.0                         # sft: train on samples with reward above this
    temperature: float = 1.0                            # the rollout's sampling temperature
    total_steps: int = 0                                # final checkpoint after this many steps; 0 = unbounded
    checkpoint_every: int = 5                           # steps between resumable checkpoints; 0 = only the final one
    keep_checkpoints: int = 2                           # newest resumable checkpoints kept in run_dir/checkpoints
    seed: int = 0
    torch_threads: int = 1
    wx_address: str = "127.0.0.1:50055"                 # weight_exchange; empty: no weight sync
    weight_transport: str = "shm"
    weight_host: str = "127.0.0.1"                      # where receivers reach this rank's weights (a container's IP)
    sync_timeout: float = 200.0                         # > weight_exchange transfer + control timeouts
    sync_retries: int = 3                               # weight-sync attempts after the first one fails

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        if self.total_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("total_steps / checkpoint_every: must be >= 0")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints: must be >= 1, got {self.keep_checkpoints}")
        if self.sync_retries < 0:
            raise ValueError(f"sync_retries: must be >= 0, got {self.sync_retries}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        self.build_algorithm()  # an unknown preset or setting stops start-up here

    def algorithm_config(self) -> AlgorithmConfig:
        """The preset with ``algo_overrides`` on top; ``max_new_tokens`` unless the overrides set it."""
        if self.algo not in PRESETS:
            raise ValueError(f"algo: unknown preset {self.algo!r}; known presets: {', '.join(PRESETS)}")
        overrides = {"max_new_tokens": self.max_new_tokens, **self.algo_overrides}
        if PRESETS[self.algo]["objective"] in ("dpo", "sft"):
            overrides = {k: v for k, v in overrides.items() if k not in _IGNORED_OFFLINE}
        try:
            return AlgorithmConfig.from_preset(self.algo, **overrides)
        except ValueError as exc:
            raise ValueError(f"algo_overrides: {exc}") from exc

    def build_algorithm(self) -> Algorithm:
        config = self.algorithm_config()
        try:
            return config.build()
        except ValueError as exc:
            raise ValueError(f"algo_overrides: {exc}") from exc
