"""vLLM, vLLM-Ascend and SGLang layouts for Llama / Qwen2 / Qwen3 / Qwen3-MoE (their parameter names).

- `qkv_proj` = [q_r; k_r; v_r]: q heads split over TP; KV heads split when TP <= num_kv_heads, otherwise each
  rank holds KV head `tp_rank // (tp / num_kv_heads)` (replicated); `o_proj` split on dim 1, its bias (when the
  model has one) whole on every rank.
- `gate_up_proj` = [gate_r; up_r]; `down_proj` split on dim 1.
- Vocab-parallel `embed_tokens` / `lm_head`: the vocabulary padded to a multiple of `vocab_padding` (64, vLLM's
  and SGLang's default; 1: unpadded), then split evenly over TP.
- Fused experts `w13_weight` [E_local, 2I/moe_tp, H] (gate half then up half) and `w2_weight`
  [E_local, H, I/moe_tp].
  * vLLM (and vLLM-Ascend): the MoE layers span every device of one engine, tp x edp (edp: the engine's own
    `--data-parallel-size`). Without expert parallelism the experts are TP-sharded over those tp x edp devices
    (moe rank = edp_rank * tp + tp_rank); with `--enable-expert-parallel` ep = tp x edp, moe_tp = 1, and rank
    `ep_rank` holds E // ep experts, the first E % ep ranks one more ("linear": contiguous ids; "round_robin":
    ids ep_rank, ep_rank + ep, ...). Any other ep (e.g. ep=2 inside tp=4) is refused. EPLB (redundant experts,
    placement that moves at run time) is refused.
  * SGLang: EP inside the TP group, moe_tp = tp / ep, ep_rank = tp_rank // moe_tp; E divisible by ep. DP
    attention (attention over tp / dp ranks, replicated embedding) and EPLB are refused.
- vLLM-Ascend transposes the fused experts after loading (`w13_weight` [E_local, H, 2I/moe_tp], `w2_weight`
  [E_local, I/moe_tp, H]). Its layout declares the pre-transpose (logical) shapes; the receiver passes
  `receiver_views(engine, params)` (transposed views sharing the live storage) as its tensors, so every byte lands
  in place in the transposed memory.
- Pipeline parallelism (`layers`): a rank holds the decoder layers [start, stop) under their global numbers, the
  embedding on the first stage (and on the last with tied embeddings), `model.norm` / `lm_head` on the last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from services.common.errors import FieldError
from services.weight_exchange.client.layout import Shard
from services.weight_exchange.client.layouts.common import (
    col_shard,
    even,
    pad_to,
    replicated,
    row_shards,
    stack,
    vocab_shard,
)
from services.weight_exchange.client.layouts.model import ModelSpec

ENGINES = ("vllm", "sglang", "vllm_ascend")
VLLM_LIKE = ("vllm", "vllm_ascend")
PLACEMENTS = ("linear", "round_robin")
TRANSPOSED_EXPERTS = ("mlp.experts.w13_weight", "mlp.experts.w2_weight")   # vLLM-Ascend, after loading


@dataclasses.dataclass(frozen=True)
class InferenceParallel:
    tp: int = 1
    tp_rank: int = 0
    ep: int = 1                 # vLLM: 1 (off) or tp * edp; SGLang: expert parallel size inside the TP group
    dp: int = 1                 # independent engine replicas (each holds a full copy)
    dp_rank: int = 0
    vocab_padding: int = 64     # pad the vocabulary to a multiple of this (1: unpadded)
    engine: str = "vllm"
    edp: int = 1                # vLLM in-engine data parallelism (--data-parallel-size): MoE spans tp * edp
    edp_rank: int = 0
    expert_placement: str = "linear"     # vLLM expert_placement_strategy: linear | round_robin
    redundant_experts: int = 0           # vLLM EPLB num_redundant_experts: unsupported (> 0 raises)
    eplb: bool = False                   # vLLM enable_eplb: unsupported (raises)
    dp_attention: int = 1                # SGLang --enable-dp-attention with this dp size: unsupported (> 1 raises)
    layers: tuple[int, int] | None = None   # pipeline stage: global decoder layers [start, stop); None: all
    expert_ids: tuple[int, ...] | None = None  # the global experts held, in local order (a live expert map)

    def as_dict(self) -> dict[str, int]:
        out = {"tp_size": self.tp, "tp_rank": self.tp_rank, "ep_size": self.ep, "dp_size": self.dp,
               "dp_rank": self.dp_rank}
        if self.edp > 1:
            out.update(edp_size=self.edp, edp_rank=self.edp_rank)
        return out


@dataclasses.dataclass(frozen=True)
class MoePartition:
    """How one rank holds the experts: TP-split size / rank of each expert, and the global experts it holds."""

    tp: int
    tp_rank: int
    experts: tuple[int, ...]


def kv_heads(spec: ModelSpec, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) held by a TP rank, replicating KV heads when TP exceeds their number."""
    nkv = spec.num_kv_heads
    if tp >= nkv:
        if tp % nkv:
            raise FieldError("tp", f"{tp} is larger than num_key_value_heads {nkv} and not a multiple of it")
        return rank // (tp // nkv), 1
    return even(nkv, tp, rank, "num_key_value_heads over tp")


def expert_ids(num_experts: int, ep: int, ep_rank: int, placement: str = "linear") -> tuple[int, ...]:
    """vLLM's expert map: E // ep experts per rank, the first E % ep ranks one more; linear or round-robin ids."""
    if placement not in PLACEMENTS:
        raise FieldError("expert_placement", f"unknown {placement!r} (known: {', '.join(PLACEMENTS)})")
    if not 0 <= ep_rank < ep:
        raise FieldError("ep_rank", f"{ep_rank} is outside [0, {ep})")
    base, extra = divmod(num_experts, ep)
    count = base + (1 if ep_rank < extra else 0)
    if count == 0:
        raise FieldError("ep", f"{ep} ranks for {num_experts} experts leave rank {ep_rank} without one")
    if placement == "round_robin":
        return tuple(range(ep_rank, num_experts, ep))
    start = ep_rank * base + min(ep_rank, extra)
    return tuple(range(start, start + count))


def moe_partition(spec: ModelSpec, par: InferenceParallel) -> MoePartition:
    """The engine's rule for splitting the experts (see the module docstring); ValueError naming the field."""
    if par.engine in VLLM_LIKE:
        if par.eplb or par.redundant_experts:
            raise FieldError("eplb", "vLLM's EPLB (enable_eplb / num_redundant_experts) is not supported: physical "
                             "experts are replicated and moved between ranks at run time, so no fixed layout holds")
        if par.dp_attention != 1:
            raise FieldError("dp_attention", "is SGLang's; vLLM's in-engine data parallelism is edp")
        devices, moe_rank = par.tp * par.edp, par.edp_rank * par.tp + par.tp_rank
        if par.ep == 1 and par.expert_placement != "linear":
            raise FieldError("expert_placement", "applies only with expert parallelism (ep = tp x edp)")
        if par.ep not in (1, devices):
            raise FieldError("ep", f"vLLM's expert parallelism spans every device of the engine (ep = tp x edp = "
                             f"{par.tp} x {par.edp} = {devices}, MoE tp = 1) or is off (ep = 1); ep={par.ep} "
                             f"inside tp={par.tp} is SGLang's layout (use sglang)")
        if par.ep == 1 or devices == 1:
            experts = par.expert_ids or tuple(range(spec.num_experts))
            return MoePartition(devices, moe_rank, experts)
        experts = par.expert_ids or expert_ids(spec.num_experts, devices, moe_rank, par.expert_placement)
        return MoePartition(1, 0, experts)
    # SGLang
    if par.eplb or par.redundant_experts:
        raise FieldError("eplb", "SGLang's EPLB (--enable-eplb / --ep-num-redundant-experts) is not supported: "
                         "physical experts are replicated and moved between ranks at run time")
    if par.edp != 1 or par.expert_placement != "linear":
        raise ValueError("edp / expert_placement: are vLLM's options; SGLang puts EP inside the TP group")
    if par.dp_attention != 1:
        raise FieldError("dp_attention", f"SGLang's DP attention (--enable-dp-attention, dp={par.dp_attention}: "
                         f"attention over tp / dp ranks, replicated embedding) is not supported; use dp (independent "
                         f"replicas) instead")
    if par.tp % par.ep:
        raise FieldError("ep", f"{par.ep} does not divide tp {par.tp}")
    moe_tp = par.tp // par.ep
    ep_rank = par.tp_rank // moe_tp
    if par.expert_ids is not None:
        experts = par.expert_ids
    else:
        e0, ne = even(spec.num_experts, par.ep, ep_rank, "num_experts over ep")
        experts = tuple(range(e0, e0 + ne))
    return MoePartition(moe_tp, par.tp_rank % moe_tp, experts)


def stage_range(spec: ModelSpec, par: InferenceParallel) -> range:
    if par.layers is None:
        return range(spec.num_layers)
    start, stop = par.layers
    if not 0 <= start < stop <= spec.num_layers:
        raise FieldError("layers", f"[{start}, {stop}) is not a non-empty range inside [0, {spec.num_layers})")
    return range(start, stop)


def inference_shards(spec: ModelSpec, par: InferenceParallel, dtype: str | None = None) -> list[Shard]:
    """Every shard one vLLM / vLLM-Ascend / SGLang rank holds."""
    if par.engine not in ENGINES:
        raise FieldError("engine", f"unknown {par.engine!r} (known: {', '.join(ENGINES)})")
    if par.vocab_padding < 1:
        raise FieldError("vocab_padding", f"must be >= 1 (1: unpadded), got {par.vocab_padding}")
    if not 0 <= par.edp_rank < par.edp:
        raise FieldError("edp_rank", f"{par.edp_rank} is outside [0, {par.edp})")
    dtype = dtype or spec.dtype
    canon = spec.canonical()
    h, tp, r = spec.hidden_size, par.tp, par.tp_rank
    even(spec.num_heads, tp, r, "num_attention_heads over tp")
    moe = moe_partition(spec, par) if spec.num_experts else None
    layers = stage_range(spec, par)
    padded = pad_to(spec.vocab_size, par.vocab_padding)
    shards: list[Shard] = []
    last = layers.stop == spec.num_layers
    if layers.start == 0 or (last and spec.tie_word_embeddings):   # vLLM: a tied last stage builds embed_tokens
        shards += vocab_shard("model.embed_tokens.weight", "model.embed_tokens.weight", spec.vocab_size, h, padded,
                              tp, r, dtype)
    for layer in layers:
        shards += _layer(spec, par, moe, layer, canon, dtype)
    if last:
        shards.append(replicated("model.norm.weight", "model.norm.weight", (h,), dtype))
        if not spec.tie_word_embeddings:
            shards += vocab_shard("lm_head.weight", "lm_head.weight", spec.vocab_size, h, padded, tp, r, dtype)
    return shards


def _layer(spec: ModelSpec, par: InferenceParallel, moe: MoePartition | None, layer: int,
           canon: dict[str, tuple[int, ...]], dtype: str) -> list[Shard]:
    h, hd, tp, r = spec.hidden_size, spec.head_dim, par.tp, par.tp_rank
    p = f"model.layers.{layer}."
    out = [replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", (h,), dtype)]
    q0, nq = even(spec.num_heads, tp, r, "num_attention_heads over tp")
    k0, nk = kv_heads(spec, tp, r)
    for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
        rows = stack([(p + f"self_attn.q_proj.{suffix}", q0 * hd, nq * hd),
                      (p + f"self_attn.k_proj.{suffix}", k0 * hd, nk * hd),
                      (p + f"self_attn.v_proj.{suffix}", k0 * hd, nk * hd)])
        shape = ((nq + 2 * nk) * hd, h) if suffix == "weight" else ((nq + 2 * nk) * hd,)
        out += row_shards(p + f"self_attn.qkv_proj.{suffix}", shape, dtype, rows, canon)
    out.append(col_shard(p + "self_attn.o_proj.weight", (h, nq * hd), dtype, p + "self_attn.o_proj.weight",
                         (h, spec.num_heads * hd), q0 * hd, nq * hd))
    if spec.o_bias:   # RowParallelLinear: the bias is whole on every rank (added once, after the reduce)
        out.append(replicated(p + "self_attn.o_proj.bias", p + "self_attn.o_proj.bias", (h,), dtype))
    if spec.qk_norm:
        out.append(replicated(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight", (hd,), dtype))
        out.append(replicated(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight", (hd,), dtype))
    out.append(replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,), dtype))
    if not spec.is_moe_layer(layer):
        i0, ni = even(spec.intermediate_size, tp, r, "intermediate_size over tp")
        rows = stack([(p + "mlp.gate_proj.weight", i0, ni), (p + "mlp.up_proj.weight", i0, ni)])
        out += row_shards(p + "mlp.gate_up_proj.weight", (2 * ni, h), dtype, rows, canon)
        out.append(col_shard(p + "mlp.down_proj.weight", (h, ni), dtype, p + "mlp.down_proj.weight",
                             (h, spec.intermediate_size), i0, ni))
        return out
    assert moe is not None
    out.append(replicated(p + "mlp.gate.weight", p + "mlp.gate.weight", (spec.num_experts, h), dtype))
    i0, ni = even(spec.moe_intermediate_size, moe.tp, moe.tp_rank, "moe_intermediate_size over the MoE tp")
    w13, w2 = p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"
    ne = len(moe.experts)
    for i, e in enumerate(moe.experts):
        if not 0 <= e < spec.num_experts:
            raise FieldError("expert_ids", f"{e} is outside [0, {spec.num_experts})")
        c = p + f"mlp.experts.{e}."
        rows = stack([(c + "gate_proj.weight", i0, ni), (c + "up_proj.weight", i0, ni)])
        out += row_shards(w13, (ne, 2 * ni, h), dtype, rows, canon, lead=(i,))
        out.append(col_shard(w2, (ne, h, ni), dtype, c + "down_proj.weight", (h, spec.moe_intermediate_size),
                             i0, ni, lead=(i,)))
    return out


def is_transposed(engine: str, local_name: str) -> bool:
    """Whether the engine keeps this local tensor transposed (last two dims) after loading."""
    return engine == "vllm_ascend" and local_name.endswith(TRANSPOSED_EXPERTS)


def receiver_views(engine: str, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a receiver of `engine` passes to ReceiverAgent / pull_all: the live parameters, with the
    post-load-transposed ones (vLLM-Ascend fused experts) as `.transpose(-2, -1)` views of the same storage, in
    the logical shapes its layout declares."""
    return {k: v.transpose(-2, -1) if is_transposed(engine, k) else v for k, v in params.items()}


def logical_shape(engine: str, local_name: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape the layout declares for a live tensor of this shape (the pre-transpose one when transposed)."""
    shape = tuple(int(s) for s in shape)
    return (*shape[:-2], shape[-1], shape[-2]) if is_transposed(engine, local_name) else shape
