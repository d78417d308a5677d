"""A side of a transfer described as text (`megatron:tp=4,pp=2,ep=8`, `vllm:tp=4,dp=2`) and its ranks.

Frameworks: hf (full model per rank), fsdp2 (dp dim-0 shards), embedded (full, inference), megatron
(tp, pp, ep, etp, dp; `first` / `last`: layers in the first / last pipeline stage when uneven, Megatron's rule;
`vocab_div`: make_vocab_size_divisible_by, 128; `unpadded=1`: the vocabulary unpadded), vllm / vllm_ascend
(tp, dp: independent replicas, edp: the engine's own --data-parallel-size, ep: 1 or tp x edp, rr=1: round-robin
expert placement, vocab_pad: 64, 1 = unpadded; eplb: refused), sglang (tp, ep inside tp, dp, vocab_pad; dpa: DP
attention, refused). Megatron global rank order is tp fastest, then dp, then pp; inside a pipeline stage the
tp x dp ranks are regrouped as etp (fastest) x ep x expert-dp for the experts. vLLM: tp fastest, then edp, then dp.
"""

from __future__ import annotations

import dataclasses

from services.common.errors import FieldError
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout, Shard
from services.weight_exchange.client.layouts.hf import fsdp2_shards, hf_shards
from services.weight_exchange.client.layouts.inference import InferenceParallel, inference_shards
from services.weight_exchange.client.layouts.megatron import MegatronParallel, megatron_shards, pipeline_stages
from services.weight_exchange.client.layouts.model import ModelSpec

_VLLM_KEYS = ("tp", "ep", "dp", "edp", "rr", "eplb", "vocab_pad")
FRAMEWORKS = {"hf": ("dp",), "fsdp2": ("dp",), "embedded": ("dp",),
              "megatron": ("tp", "pp", "ep", "etp", "dp", "first", "last", "vocab_div", "unpadded"),
              "vllm": _VLLM_KEYS, "vllm_ascend": _VLLM_KEYS, "sglang": ("tp", "ep", "dp", "dpa", "vocab_pad")}
SENDING = ("hf", "fsdp2", "megatron")
RECEIVING = ("embedded", "hf", "vllm", "vllm_ascend", "sglang", "megatron", "fsdp2")
INFERENCE = ("vllm", "vllm_ascend", "sglang")


@dataclasses.dataclass(frozen=True)
class Side:
    framework: str
    sizes: dict[str, int]

    def __str__(self) -> str:
        return self.framework + ":" + ",".join(f"{k}={v}" for k, v in self.sizes.items() if v != 1) \
            if any(v != 1 for v in self.sizes.values()) else self.framework

    def get(self, key: str) -> int:
        return self.sizes.get(key, 1)

    @property
    def world(self) -> int:
        if self.framework == "megatron":
            return self.get("tp") * self.get("pp") * self.get("dp")
        if self.framework in INFERENCE:
            return self.get("tp") * self.get("edp") * self.get("dp")
        return self.get("dp")


def parse_side(text: str, field: str = "side") -> Side:
    """`megatron:tp=4,pp=2,ep=8` -> Side; ValueError naming `field` on bad input."""
    framework, _, rest = text.partition(":")
    if framework not in FRAMEWORKS:
        raise FieldError(field, f"unknown framework {framework!r} (known: {', '.join(FRAMEWORKS)})")
    sizes: dict[str, int] = {}
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key not in FRAMEWORKS[framework]:
            raise FieldError(field, f"{framework} takes {', '.join(FRAMEWORKS[framework])}, not {key!r}")
        if not value.isdigit() or int(value) < 1:
            raise FieldError(field, f"{key} must be a positive integer, got {value!r}")
        sizes[key] = int(value)
    if "eplb" in sizes:
        raise FieldError(field, "eplb: vLLM's EPLB (redundant experts moved between ranks at run time) is not "
                         "supported")
    if sizes.get("dpa", 1) > 1:
        raise FieldError(field, "dpa: SGLang's DP attention (attention over tp / dp ranks, replicated embedding) "
                         "is not supported; use dp (independent replicas)")
    return Side(framework, sizes)


def megatron_parallel(side: Side, rank: int, num_layers: int = 0) -> MegatronParallel:
    tp, pp, dp, ep = side.get("tp"), side.get("pp"), side.get("dp"), side.get("ep")
    stages = None
    if "first" in side.sizes or "last" in side.sizes:
        stages = pipeline_stages(num_layers, pp, side.sizes.get("first"), side.sizes.get("last"))
    etp = side.get("etp") if "etp" in side.sizes else tp   # Megatron's default: expert TP = TP
    if (tp * dp) % (ep * etp):
        raise FieldError("side", f"ep {ep} x etp {etp} must divide tp {tp} x dp {dp} (Megatron's expert groups; "
                         f"set etp)")
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    k = tp_rank + tp * dp_rank
    return MegatronParallel(tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank, ep=ep, ep_rank=(k // etp) % ep,
                            etp=etp, etp_rank=k % etp, dp=dp, dp_rank=dp_rank, layers_per_stage=stages,
                            vocab_divisor=side.sizes.get("vocab_div", 128), vocab_unpadded="unpadded" in side.sizes)


def inference_parallel(side: Side, rank: int) -> InferenceParallel:
    tp, edp, dp = side.get("tp"), side.get("edp"), side.get("dp")
    return InferenceParallel(tp=tp, tp_rank=rank % tp, ep=side.get("ep"), dp=dp, dp_rank=rank // (tp * edp),
                             edp=edp, edp_rank=(rank // tp) % edp, engine=side.framework,
                             vocab_padding=side.sizes.get("vocab_pad", 64),
                             expert_placement="round_robin" if "rr" in side.sizes else "linear")


def rank_shards(spec: ModelSpec, side: Side, rank: int, dtype: str | None = None) -> tuple[list[Shard], dict[str, int]]:
    """The shards of global rank `rank` of a side, and its parallel coordinates."""
    dtype = dtype or spec.dtype
    if not 0 <= rank < side.world:
        raise FieldError("rank", f"{rank} is outside [0, {side.world}) for {side}")
    fw = side.framework
    if fw in ("hf", "embedded"):
        shards = [s for name, shape in spec.canonical().items() for s in hf_shards(name, shape, dtype)]
        return shards, {"dp_rank": rank, "dp_size": side.get("dp")}
    if fw == "fsdp2":
        canon = spec.canonical()
        local = {}
        for name, shape in canon.items():
            chunk = -(-shape[0] // side.get("dp"))
            rows = max(0, min(shape[0], (rank + 1) * chunk) - min(shape[0], rank * chunk))
            local[name] = _Meta((rows, *shape[1:]), dtype)
        return fsdp2_shards(local, rank, side.get("dp"), canon), {"dp_rank": rank, "dp_size": side.get("dp")}
    if fw == "megatron":
        par = megatron_parallel(side, rank, spec.num_layers)
        return megatron_shards(spec, par, dtype), par.as_dict()
    par = inference_parallel(side, rank)
    return inference_shards(spec, par, dtype), par.as_dict()


def side_layouts(spec: ModelSpec, side: Side, role: str, prefix: str, dtype: str | None = None) -> list[RankLayout]:
    """Layouts of every rank of a side (rank ids `<prefix>-<rank>`), without endpoints or addresses."""
    if role == SENDER and side.framework not in SENDING:
        raise FieldError("src", f"{side.framework} cannot send (senders: {', '.join(SENDING)})")
    if role == RECEIVER and side.framework not in RECEIVING:
        raise FieldError("dst", f"{side.framework} cannot receive (receivers: {', '.join(RECEIVING)})")
    out = []
    cache: dict[tuple, list[Shard]] = {}   # ranks that differ only in dp_rank share one shard list
    for rank in range(side.world):
        parallel = _coordinates(side, rank, spec.num_layers)
        key = tuple(sorted((k, v) for k, v in parallel.items() if k != "dp_rank"))
        if key not in cache or side.framework == "fsdp2":
            cache[key], parallel = rank_shards(spec, side, rank, dtype)
        out.append(RankLayout(f"{prefix}-{rank}", role, side.framework, cache[key], parallel))
    return out


def _coordinates(side: Side, rank: int, num_layers: int) -> dict[str, int]:
    if side.framework == "megatron":
        return megatron_parallel(side, rank, num_layers).as_dict()
    if side.framework in INFERENCE:
        return inference_parallel(side, rank).as_dict()
    return {"dp_rank": rank}


class _Meta:
    """Shape and dtype standing in for a local tensor (layouts without memory)."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape = shape
        self.dtype = dtype
