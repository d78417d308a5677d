"""The trainer service's configuration."""

from __future__ import annotations

import dataclasses
from typing import Any

from services.common.config import ServiceConfig
from services.common.device import check_device
from services.common.errors import FieldError
from services.trainer.algorithms import PRESETS, Algorithm, AlgorithmConfig
from services.trainer.critic import CriticConfig
from services.trainer.lora import LoraConfig
from services.trainer.optim import OptimConfig
from services.trainer.packing import PackingConfig
from services.trainer.reference import ReferenceConfig

# Run configs switch dynamic sampling on for the online presets; an offline objective selects its own
# samples (DPO skips tied groups, which is what dynamic sampling would drop), so there it is ignored.
_IGNORED_OFFLINE = ("dynamic_sampling",)


@dataclasses.dataclass(kw_only=True)
class MegatronConfig:
    """``backend: megatron``: megatron-core's parallel sizes; data parallel is what ``ranks`` leaves over."""
    tp: int = 1   # tensor-parallel ranks
    pp: int = 1   # pipeline stages: megatron-core's 1F1B schedule (without interleaving) over them
    ep: int = 1   # expert-parallel ranks of a MoE model: each holds num_experts / ep experts
    # expert tensor-parallel ranks: each expert's matrices split like the dense MLP's; 0: tp (megatron-core's
    # default). etp 1 with tp 2 and ep 2 on two ranks: attention split in two, each rank two whole experts
    etp: int = 0
    # uneven stages, as Megatron names them: the first / last stage's layers, the rest split evenly over the
    # other stages (the weight exchange's layouts follow the same rule); None: every stage alike
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    microbatches: int = 0  # pp > 1: microbatches per minibatch through the pipeline; 0: 2 x pp
    # a MoE model's router load-balancing loss (Switch-style aux loss, megatron-core's `aux_loss`), added to the
    # policy loss in every forward that trains; 0: none
    moe_aux_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.etp < 0:
            raise FieldError("etp", f"must be >= 1 (or 0: tp), got {self.etp}")
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            if value is not None and (self.pp == 1 or value < 1):
                raise FieldError(name, f"needs pp > 1 and a value >= 1, got {value} with pp {self.pp}")
        if self.microbatches < 0:
            raise FieldError("microbatches", f"must be >= 0, got {self.microbatches}")
        if not 0.0 <= self.moe_aux_loss_coeff < float("inf"):
            raise FieldError("moe_aux_loss_coeff", f"must be >= 0, got {self.moe_aux_loss_coeff}")

    def dp(self, ranks: int) -> int:
        return ranks // (self.tp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def pipeline_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    def side(self, ranks: int) -> str:
        """The weight exchange's name of this layout (``megatron:tp=2,pp=1,ep=1,dp=2``; uneven stages add
        ``first=`` / ``last=``)."""
        out = f"megatron:tp={self.tp},pp={self.pp},ep={self.ep},dp={self.dp(ranks)}"
        for key, value in (("etp", self.etp or None), ("first", self.num_layers_in_first_pipeline_stage),
                           ("last", self.num_layers_in_last_pipeline_stage)):
            out += f",{key}={value}" if value is not None else ""
        return out


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
    packing: PackingConfig = dataclasses.field(default_factory=PackingConfig)  # sequence packing of the forwards
    # recompute each decoder layer's activations in the backward instead of keeping them (Hugging Face models): a
    # step then holds about one layer's activations, not all of them, for ~1/3 more compute; for long rows
    # (agents' ~3,000-token prompts: 8 rows of SmolLM2 in float32 held 15 GB without it)
    gradient_checkpointing: bool = False
    # MoE routing replay (R3): the policy's forwards route each token to the experts the rollout's engine chose
    # for it (recorded when the engine's record_routes is on); tokens without a record route themselves
    routing_replay: bool = False
    max_new_tokens: int = 8                             # the generation limit: the launcher sets builder.sampling.max_new_tokens
    sft_min_reward: float = 0.0                         # sft: train on samples with reward above this
    temperature: float = 1.0                            # log-probs at this temperature: the launcher sets builder.sampling.temperature; a batch sampled at another is skipped
    total_steps: int = 0                                # final checkpoint after this many steps (the launcher sets the builder's); 0 = unbounded
    checkpoint_every: int = 5                           # steps between resumable checkpoints; 0 = only the final one
    keep_checkpoints: int = 2                           # newest resumable checkpoints kept in run_dir/checkpoints
    checkpoint_on_stop: bool = True                     # stopped (SIGTERM) with untaken steps: a resumable checkpoint
    seed: int = 0
    dtype: str = "float32"                              # bfloat16: forward and backward under bf16 autocast
    torch_threads: int = 1                              # OpenMP threads of the thread that builds, steps and saves the model; 0: torch's default
    device: str = "cpu"                                 # cpu | cuda | npu, or cuda:N / npu:N: model, batches, optimizer
    backend: str = "torch"                              # torch (one process) | fsdp2 (sharded over ranks) | megatron
    ranks: int = 1                                      # trainer processes (fsdp2: data-parallel ranks; megatron: tp x dp; rank 0 serves)
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)  # backend: megatron
    rank_timeout: float = 120.0                         # seconds a rank waits on another before the group fails
    shard_sync: bool = False                            # fsdp2, megatron: every rank serves its own shards to the weight sync
    wx_address: str = "127.0.0.1:50055"                 # weight_exchange; empty: no weight sync
    weight_transport: str = "shm"
    weight_host: str = "127.0.0.1"                      # where receivers reach this rank's weights (a container's IP)
    sync_timeout: float = 200.0                         # > weight_exchange transfer + control timeouts
    sync_retries: int = 3                               # weight-sync attempts after the first one fails

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise FieldError("dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        if self.temperature <= 0:
            raise FieldError("temperature", f"must be > 0, got {self.temperature}")
        if self.total_steps < 0 or self.checkpoint_every < 0:
            raise ValueError("total_steps / checkpoint_every: must be >= 0")
        if self.keep_checkpoints < 1:
            raise FieldError("keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        if self.sync_retries < 0:
            raise FieldError("sync_retries", f"must be >= 0, got {self.sync_retries}")
        if self.max_new_tokens < 1:
            raise FieldError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        check_device(self.device)
        algo = self.build_algorithm()  # an unknown preset or setting stops start-up here
        teacher = self.reference.model_path or self.reference.url or self.reference.served
        if (algo.config.distill_coef > 0 or algo.config.distill_topk > 0) and not teacher:
            raise FieldError("reference.model_path", f"{self.algo!r} distils from a teacher: set its checkpoint here, "
                             "or serve it (reference.served; the default, the policy's own start, teaches nothing)")
        self.check_backend()

    def check_backend(self) -> None:
        from services.trainer.backends import BACKENDS

        if self.backend not in BACKENDS:
            raise FieldError("backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.ranks < 1:
            raise FieldError("ranks", f"must be >= 1, got {self.ranks}")
        if self.rank_timeout <= 0:
            raise FieldError("rank_timeout", f"must be > 0, got {self.rank_timeout}")
        if self.backend == "torch" and self.ranks != 1:
            raise FieldError("ranks", f"the torch backend runs one rank, got {self.ranks} (backend: fsdp2 shards)")
        if self.shard_sync and self.backend not in ("fsdp2", "megatron"):
            raise FieldError("shard_sync", f"needs backend: fsdp2 or megatron, got {self.backend!r}")
        if self.backend == "fsdp2":
            algo = self.build_algorithm()
            if self.lora.enabled:
                raise FieldError("lora.enabled", "the fsdp2 backend trains full weights only (use backend: torch)")
            if algo.is_offline or algo.needs_critic:
                raise FieldError("backend", f"fsdp2 runs the online presets without a critic; {self.algo!r} "
                                 "needs backend: torch")
        if self.backend == "megatron":
            self.check_megatron()

    def check_megatron(self) -> None:
        m, algo = self.megatron, self.build_algorithm()
        if self.ranks % (m.tp * m.pp):
            raise FieldError("ranks", f"{self.ranks} ranks do not split into tp {m.tp} x pp {m.pp} x data parallel")
        if self.ranks % (m.ep * m.expert_tp * m.pp):
            raise FieldError("megatron.ep", f"{self.ranks} ranks do not split into ep {m.ep} x expert tp "
                             f"{m.expert_tp} x pp {m.pp} (Megatron's expert groups; megatron.etp sets expert tp)")
        if self.lora.enabled:
            raise FieldError("lora.enabled", "the megatron backend trains full weights only (use backend: torch)")
        if algo.is_offline or algo.needs_critic:
            raise FieldError("backend", f"megatron runs the online presets without a critic; {self.algo!r} "
                             "needs backend: torch")
        if self.packing.enabled:
            raise FieldError("packing.enabled", "the megatron backend runs padded rows; set packing.enabled: false")
        if algo.config.distill_topk > 0:
            raise FieldError("algo_overrides.distill_topk", "the megatron backend has no teacher top-k term yet (its "
                             "logits are split over tensor-parallel ranks); use backend: torch or fsdp2")
        if self.routing_replay and m.pp > 1:
            raise FieldError("routing_replay", "the megatron backend replays routes without pipeline stages (pp 1)")

    def algorithm_config(self) -> AlgorithmConfig:
        """The preset with ``algo_overrides`` on top; ``max_new_tokens`` unless the overrides set it."""
        if self.algo not in PRESETS:
            raise FieldError("algo", f"unknown preset {self.algo!r}; known presets: {', '.join(PRESETS)}")
        overrides = {"max_new_tokens": self.max_new_tokens, **self.algo_overrides}
        if PRESETS[self.algo]["objective"] in ("dpo", "sft"):
            overrides = {k: v for k, v in overrides.items() if k not in _IGNORED_OFFLINE}
        try:
            return AlgorithmConfig.from_preset(self.algo, **overrides)
        except ValueError as exc:
            raise FieldError("algo_overrides", f"{exc}") from exc

    def build_algorithm(self) -> Algorithm:
        config = self.algorithm_config()
        try:
            return config.build()
        except ValueError as exc:
            raise FieldError("algo_overrides", f"{exc}") from exc
