"""Per-rank peak memory of a training step, in steady state (the step after the first: the optimizer state
exists and the previous update's gradients are still held while the next forward runs, since
``apply_update`` frees them only right before its backward).

peak = parameters + gradients + optimizer state + max(activations, optimizer-step temporaries)
       + weight-sync buffers
"""

from __future__ import annotations

import dataclasses

from services.common.errors import FieldError
from services.trainer.planning import params as counts
from services.trainer.planning.activations import ITEMSIZE, Workload, hf_activation_bytes, megatron_activation_bytes
from services.trainer.planning.model import PlannedModel
from services.weight_exchange.client.layouts.common import pad_to
from services.weight_exchange.client.layouts.megatron import MegatronParallel
from services.weight_exchange.client.layouts.topology import Side, megatron_parallel, parse_side
from services.weight_exchange.client.transfer import DEFAULT_BUCKET_BYTES

BACKENDS = ("torch", "fsdp2", "megatron")
DEVICES = ("cpu", "cuda", "npu")
TRANSPORTS = ("shm", "tcp")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "weight_sync")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    backend: str = "torch"              # torch | fsdp2 | megatron:tp=..,pp=..,ep=..
    dp: int = 1
    micro_batch_tokens: int = 2048      # tokens in one forward on one rank
    seq_len: int = 0                    # padded row length; 0: one row of micro_batch_tokens
    dtype: str = "float32"              # compute dtype (torch / fsdp2: bf16 autocast over float32 weights)
    optimizer: str = "adamw"
    lora_rank: int = 0
    device: str = "cuda"                # cpu: AdamW steps tensor by tensor; cuda / npu: foreach over all of them
    device_memory: int = 80 << 30
    weight_transport: str = "shm"

    def __post_init__(self) -> None:
        framework = self.backend.partition(":")[0]
        if framework not in BACKENDS:
            raise FieldError("backend", f"must be torch, fsdp2 or megatron:tp=..,pp=..,ep=.., got {self.backend!r}")
        if framework != "megatron" and ":" in self.backend:
            raise FieldError("backend", f"{framework} takes no sizes (use --dp), got {self.backend!r}")
        if self.dp < 1:
            raise FieldError("dp", f"must be >= 1, got {self.dp}")
        if framework == "torch" and self.dp != 1:
            raise FieldError("dp", f"the torch backend is one rank, got {self.dp} (use fsdp2 or megatron)")
        if self.micro_batch_tokens < 1:
            raise FieldError("micro_batch_tokens", f"must be >= 1, got {self.micro_batch_tokens}")
        if self.seq_len < 0 or self.seq_len > self.micro_batch_tokens:
            raise FieldError("seq_len", f"must be in [1, micro_batch_tokens], got {self.seq_len}")
        if self.dtype not in ITEMSIZE:
            raise FieldError("dtype", f"must be float32 or bfloat16, got {self.dtype!r}")
        if self.optimizer != "adamw":
            raise FieldError("optimizer", f"only adamw is planned, got {self.optimizer!r}")
        if self.lora_rank < 0:
            raise FieldError("lora_rank", f"must be >= 0, got {self.lora_rank}")
        if self.lora_rank and framework != "torch":
            raise FieldError("lora_rank", f"LoRA trains on the torch backend only, not {framework}")
        if self.device not in DEVICES:
            raise FieldError("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device_memory < 1:
            raise FieldError("device_memory", f"must be positive, got {self.device_memory}")
        if self.weight_transport not in TRANSPORTS:
            raise FieldError("weight_transport", f"must be shm or tcp, got {self.weight_transport!r}")
        self.side()  # bad megatron sizes stop here

    @property
    def framework(self) -> str:
        return self.backend.partition(":")[0]

    def side(self) -> Side:
        if self.framework != "megatron":
            return Side(self.framework, {"dp": self.dp})
        side = parse_side(self.backend, "backend")
        if "dp" in side.sizes and side.sizes["dp"] != self.dp:
            raise FieldError("backend", f"dp={side.sizes['dp']} contradicts --dp {self.dp}")
        return Side("megatron", {**side.sizes, "dp": self.dp})

    def workload(self) -> Workload:
        return Workload(self.micro_batch_tokens, self.seq_len or self.micro_batch_tokens, self.dtype, self.lora_rank)


@dataclasses.dataclass
class RankPlan:
    rank: int
    what: str                          # its coordinates, e.g. "tp_rank=0 pp_rank=1"
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    weight_sync: int
    detail: dict[str, int] = dataclasses.field(default_factory=dict)   # parts of the categories, host staging

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)

    def breakdown(self) -> dict[str, int]:
        return {**{name: getattr(self, name) for name in CATEGORIES}, "total": self.total}


@dataclasses.dataclass
class Plan:
    config: PlanConfig
    ranks: list[RankPlan]
    notes: list[str]

    @property
    def peak(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.config.device_memory

    @property
    def margin(self) -> int:
        return self.config.device_memory - self.peak.total


def plan(model: PlannedModel, config: PlanConfig) -> Plan:
    if config.framework == "torch":
        return Plan(config, [_torch_rank(model, config)], _notes(config))
    if config.framework == "fsdp2":
        return Plan(config, [_fsdp2_rank(model, config, r) for r in range(config.dp)], _notes(config))
    side = config.side()
    return Plan(config, [_megatron_rank(model, config, side, r) for r in range(side.world)], _notes(config))


def _optimizer_temporaries(config: PlanConfig, trainable: int, largest: int) -> int:
    """AdamW's step: tensor by tensor on CPU (sqrt and divide of the largest), foreach on accelerators (a
    float32 sqrt of every second moment at once)."""
    return 2 * 4 * largest if config.device == "cpu" else 4 * trainable


def _host_staging(config: PlanConfig, largest_bytes: int) -> int:
    """Host memory the sender stages while serving (not device memory): none when CPU tensors go by
    cross-memory attach; the /dev/shm ring's two buckets for device tensors; one tensor's copy over tcp."""
    if config.weight_transport == "tcp":
        return 0 if config.device == "cpu" else largest_bytes
    return 0 if config.device == "cpu" else 2 * DEFAULT_BUCKET_BYTES


def _torch_rank(model: PlannedModel, config: PlanConfig) -> RankPlan:
    spec, w = model.spec, config.workload()
    full = counts.full_parameters(spec)
    trainable, largest, merged = full.numel, full.largest, 0
    if config.lora_rank:
        trainable, adapted = counts.lora_numel(spec, config.lora_rank)
        largest = config.lora_rank * max(max(s) for s in spec.layer_tensors(0).values())  # the widest adapter
        merged = adapted
    acts = hf_activation_bytes(model, w)
    if config.dtype == "bfloat16":
        acts["autocast_weights"] = 2 * counts.linear_numel(spec)
    lora_params = trainable if config.lora_rank else 0
    temps = _optimizer_temporaries(config, trainable, largest)
    return RankPlan(0, "single process", 4 * (full.numel + lora_params), 4 * trainable, 8 * trainable,
                    max(sum(acts.values()), temps), 4 * merged,
                    {**{f"activations.{k}": v for k, v in acts.items()}, "optimizer_step_temporaries": temps,
                     "host_staging": _host_staging(config, 4 * full.largest)})


def _fsdp2_rank(model: PlannedModel, config: PlanConfig, rank: int) -> RankPlan:
    spec, w = model.spec, config.workload()
    local = counts.fsdp2_parameters(spec, config.dp, rank)
    full = counts.full_parameters(spec)
    biggest_layer = max(counts.layer_numel(spec, n) for n in range(spec.num_layers))
    # the root group (embeddings, norm, head) stays gathered from its forward to its backward; a layer is
    # gathered while it runs, the next one prefetched
    gathered = 4 * (counts.root_numel(spec) + 2 * biggest_layer)
    acts = hf_activation_bytes(model, w)
    acts["gathered_parameters"] = gathered
    if config.dtype == "bfloat16":
        acts["autocast_weights"] = 2 * counts.linear_numel(spec)
    temps = _optimizer_temporaries(config, local.numel, local.largest)
    sync = 4 * full.numel if rank == 0 else 0   # rank 0 keeps full copies of the weights for the sender
    return RankPlan(rank, f"dp_rank={rank}", 4 * local.numel, 4 * local.numel, 8 * local.numel,
                    max(sum(acts.values()), temps), sync,
                    {**{f"activations.{k}": v for k, v in acts.items()}, "optimizer_step_temporaries": temps,
                     "host_staging": _host_staging(config, 4 * full.largest) if rank == 0 else 0})


def _megatron_rank(model: PlannedModel, config: PlanConfig, side: Side, rank: int) -> RankPlan:
    """meshrl's megatron backend: float32 parameters (bf16 by autocast), AdamW over this rank's shards, and on
    global rank 0 the gathered float32 transformers copy that checkpoints (and, without shard_sync, the weight
    sync) read: host memory, so in the total only on a CPU device."""
    spec, w = model.spec, config.workload()
    par: MegatronParallel = megatron_parallel(side, rank, spec.num_layers)
    local = counts.megatron_parameters(spec, side, rank)
    acts = megatron_activation_bytes(
        model, w, tp=par.tp, etp=par.etp or par.tp, layers=local.layers, first=par.pp_rank == 0,
        last=par.pp_rank == par.pp - 1, in_flight=par.pp - par.pp_rank,
        padded_vocab=pad_to(spec.vocab_size, par.vocab_divisor * par.tp))
    if config.dtype == "bfloat16":
        acts["autocast_weights"] = 2 * local.numel
    what = " ".join(f"{k}={v}" for k, v in par.as_dict().items() if k.endswith("_rank"))
    gathered = 4 * counts.full_parameters(spec).numel if rank == 0 else 0
    on_device = config.device == "cpu"
    # rank 0 gathers every rank's shards (after each step without shard_sync, before each checkpoint with it),
    # outside the step's forward: every rank's state pickled and unpickled, its own pickle, the canonical tensors
    # and their transformers copies
    gather = 0
    if rank == 0 and on_device:
        shards = 4 * sum(counts.megatron_parameters(spec, side, r).numel for r in range(side.world))
        gather = 2 * shards + 4 * local.numel + 2 * gathered
    return RankPlan(rank, what, 4 * local.numel, 4 * local.numel, 8 * local.numel, max(sum(acts.values()), gather),
                    gathered if on_device else 0,
                    {**{f"activations.{k}": v for k, v in acts.items()}, "gather_to_rank0": gather,
                     "host_staging": _host_staging(config, 4 * local.largest) + (0 if on_device else gathered)})


def _notes(config: PlanConfig) -> list[str]:
    notes = ["steady state: the previous update's gradients are held during the next forward"]
    if config.framework == "megatron":
        notes += ["megatron: float32 parameters and gradients, optimizer not sharded over dp (no distributed "
                  "optimizer), no activation recomputation, 1F1B with pp - stage micro-batches in flight",
                  "megatron: the full vocabulary's logits on every TP rank of the last stage; rank 0 holds a "
                  "gathered float32 copy of the whole model in host memory (weight_sync on a CPU device, "
                  "host_staging elsewhere)"]
    if config.framework == "fsdp2":
        notes.append("fsdp2: rank 0 keeps full float32 copies of the weights for the weight sync")
    notes.append("host_staging is host memory, outside the total")
    return notes
