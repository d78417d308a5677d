"""The builder service's configuration."""

from __future__ import annotations

import dataclasses

from services.builder.datasets import DatasetConfig
from services.builder.tasks import SamplingConfig
from services.common.config import ServiceConfig, check_lease_seconds
from services.common.errors import FieldError

FLOAT32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(kw_only=True)
class BuilderConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50053"
    model_path: str = "artifacts/models/tiny-qwen3"  # for the tokenizer that encodes prompts
    seed: int = 0
    source: str = "dataset"       # "dataset": issue prompt work; "online": only group arriving (gateway) trajectories
    batch_size: int = 16          # groups per training batch
    group_size: int = 8           # samples per prompt
    max_staleness: int = 1        # eta
    total_steps: int = 0          # batches to publish; 0 = unbounded
    train_size: int = 5000
    eval_size: int = 200
    eval_every: int = 10          # versions between held-out evals (0: only before and after)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    eval_max_new_tokens: int = 8
    dynamic_sampling: bool = False  # DAPO: drop groups of equal rewards, issue prompts in their place
    max_abs_reward: float = 1e6   # a scored trajectory's reward (and step rewards) beyond +-this is dead-lettered
    # tokens of a trajectory at most, for the check that the run's trajectories in flight fit TRAJ's byte cap
    # (services.builder.capacity); 0: the longest prompt + max_new_tokens (dataset), the rollout's max_context
    # (online, filled in by the run file), unchecked for an online builder started alone
    max_trajectory_tokens: int = 0
    group_timeout_s: float = 1800.0  # an issued group not complete this long after its issue is dropped ("timeout")
    final_checkpoint_timeout_s: float = 300.0  # RUN_END waits this long at most for the trainer's final checkpoint
    lease_seconds: float = 15.0   # one active builder: a second one waits as standby until the lease lapses this long
    dataset: DatasetConfig = dataclasses.field(default_factory=DatasetConfig)  # the run config's `dataset:`

    def __post_init__(self) -> None:
        if self.source not in ("dataset", "online"):
            raise FieldError("source", f"must be 'dataset' or 'online', got {self.source!r}")
        for name in ("batch_size", "group_size"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.max_abs_reward <= FLOAT32_MAX:
            raise FieldError("max_abs_reward", f"must be in (0, {FLOAT32_MAX:.8g}] (rewards travel as float32), "
                             f"got {self.max_abs_reward}")
        check_lease_seconds(self.lease_seconds)
        if not self.final_checkpoint_timeout_s >= 0:
            raise FieldError("final_checkpoint_timeout_s", f"must be >= 0, got {self.final_checkpoint_timeout_s}")
        if not self.group_timeout_s > 0:
            raise FieldError("group_timeout_s", f"must be > 0, got {self.group_timeout_s}")
        if self.max_trajectory_tokens < 0:
            raise FieldError("max_trajectory_tokens", f"must be >= 0, got {self.max_trajectory_tokens}")
        if self.max_staleness < 0:
            raise FieldError("max_staleness", f"must be >= 0, got {self.max_staleness}")
