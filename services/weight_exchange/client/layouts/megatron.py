"""Megatron-core GPTModel layouts (TP x PP x EP x DP), in the names `GPTModel.named_parameters()` uses.

- `linear_qkv` rows: per query group `[q (np/ng heads); k; v]`, split contiguously over TP (a group may be
  cut when TP > ng); `linear_fc1` = `[gate_r; up_r]`; `linear_proj` / `linear_fc2` split on dim 1.
- Vocab-parallel `word_embeddings` / `output_layer` padded to a multiple of `vocab_divisor * tp`
  (`make_vocab_size_divisible_by`, 128), or unpadded (`vocab_unpadded`: split evenly over tp, as Megatron-Bridge
  exports; the vocabulary must divide by tp).
- Pipeline stages number their layers from 0; global layer = stage offset + local index. Uneven stages: with
  `num_layers_in_first_pipeline_stage` and / or `..._last_...` set, the remaining layers are divided evenly over
  the remaining stages (`pipeline_stages`).
- MoE experts: global expert = ep_rank * (E / ep) + i, expert TP `etp` splits like the dense MLP.
- Norms: `input_layernorm` / `pre_mlp_layernorm` (local spec) or, with Transformer Engine, fused into
  `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (dense layers).
"""

from __future__ import annotations

import dataclasses

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
    window,
)
from services.weight_exchange.client.layouts.model import ModelSpec


@dataclasses.dataclass(frozen=True)
class MegatronParallel:
    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int | None = None          # expert tensor parallel size (default: tp)
    etp_rank: int | None = None     # (default: tp_rank)
    dp: int = 1
    dp_rank: int = 0
    vocab_divisor: int = 128        # make_vocab_size_divisible_by (padded to a multiple of it x tp)
    vocab_unpadded: bool = False    # the vocabulary as is, split evenly over tp (Megatron-Bridge exports)
    te_fused_norms: bool = False    # Transformer Engine spec: norms live inside linear_qkv / linear_fc1
    grouped_experts: bool = False   # TEGroupedMLP names (linear_fc1.weight{i}) instead of local_experts.{i}
    layers_per_stage: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, int]:
        return {"tp_size": self.tp, "tp_rank": self.tp_rank, "pp_size": self.pp, "pp_rank": self.pp_rank,
                "ep_size": self.ep, "ep_rank": self.ep_rank, "etp_size": self.etp or self.tp,
                "etp_rank": self.tp_rank if self.etp_rank is None else self.etp_rank,
                "dp_size": self.dp, "dp_rank": self.dp_rank}


def pipeline_stages(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Layers per pipeline stage by Megatron's rule: `first` / `last` (either may be None) take their stages, the
    rest of the layers are divided evenly over the remaining stages; ValueError when they do not divide."""
    if first is None and last is None:
        _, size = even(num_layers, pp, 0, "num_layers over pp")
        return (size,) * pp
    rest, stages = num_layers, pp
    for what, n in (("first", first), ("last", last)):
        if n is not None:
            if n < 0:
                raise FieldError(what, f"must be >= 0, got {n}")
            rest, stages = rest - n, stages - 1
    if stages < 0 or rest < 0 or (stages == 0 and rest) or (stages and rest % stages):
        raise ValueError(f"first / last: {num_layers} layers with first={first}, last={last} leave {rest} layers "
                         f"that do not divide evenly over the {max(stages, 0)} other stages of pp={pp}")
    middle = rest // stages if stages else 0
    out = [middle] * pp
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return tuple(out)


def stage_layers(spec: ModelSpec, par: MegatronParallel) -> range:
    """Global layer numbers held by this pipeline stage."""
    if not 0 <= par.pp_rank < par.pp:
        raise FieldError("pp_rank", f"{par.pp_rank} is outside [0, {par.pp})")
    if par.layers_per_stage is not None:
        if len(par.layers_per_stage) != par.pp or sum(par.layers_per_stage) != spec.num_layers:
            raise FieldError("layers_per_stage", f"{par.layers_per_stage} must have {par.pp} entries summing to "
                             f"{spec.num_layers}")
        start = sum(par.layers_per_stage[:par.pp_rank])
        return range(start, start + par.layers_per_stage[par.pp_rank])
    start, size = even(spec.num_layers, par.pp, par.pp_rank, "num_layers over pp")
    return range(start, start + size)


def qkv_rows(spec: ModelSpec, layer: int, suffix: str = "weight") -> list[tuple[str, int, int]]:
    """The full (unsharded) `linear_qkv` rows: per query group [q heads; k; v]."""
    hd, ng = spec.head_dim, spec.num_kv_heads
    if spec.num_heads % ng:
        raise FieldError("num_attention_heads", f"{spec.num_heads} is not a multiple of num_key_value_heads {ng}")
    qpg = spec.num_heads // ng
    p = f"model.layers.{layer}.self_attn."
    out = []
    for g in range(ng):
        out += [(p + f"q_proj.{suffix}", g * qpg * hd, qpg * hd), (p + f"k_proj.{suffix}", g * hd, hd),
                (p + f"v_proj.{suffix}", g * hd, hd)]
    return out


def megatron_shards(spec: ModelSpec, par: MegatronParallel, dtype: str | None = None) -> list[Shard]:
    """Every shard one Megatron rank holds."""
    dtype = dtype or spec.dtype
    canon = spec.canonical()
    h, tp, r = spec.hidden_size, par.tp, par.tp_rank
    even(spec.num_heads, tp, r, "num_attention_heads over tp")
    if spec.num_kv_heads >= tp:
        even(spec.num_kv_heads, tp, r, "num_key_value_heads over tp")
    elif tp % spec.num_kv_heads:
        raise FieldError("tp", f"{tp} is larger than num_key_value_heads {spec.num_kv_heads} and not a multiple of it")
    layers = stage_layers(spec, par)
    shards: list[Shard] = []
    if par.vocab_divisor < 1:
        raise FieldError("vocab_divisor", f"must be >= 1, got {par.vocab_divisor}")
    padded = spec.vocab_size if par.vocab_unpadded else pad_to(spec.vocab_size, par.vocab_divisor * tp)
    if par.pp_rank == 0:
        shards += vocab_shard("embedding.word_embeddings.weight", "model.embed_tokens.weight", spec.vocab_size, h,
                              padded, tp, r, dtype)
    for i, layer in enumerate(layers):
        shards += _layer(spec, par, layer, f"decoder.layers.{i}.", canon, dtype)
    if par.pp_rank == par.pp - 1:
        shards.append(replicated("decoder.final_layernorm.weight", "model.norm.weight", (h,), dtype))
        if not spec.tie_word_embeddings or par.pp > 1:
            shards += vocab_shard("output_layer.weight", spec.lm_head_name, spec.vocab_size, h, padded, tp, r, dtype)
    return shards


def _layer(spec: ModelSpec, par: MegatronParallel, layer: int, p: str, canon: dict[str, tuple[int, ...]],
           dtype: str) -> list[Shard]:
    h, hd, tp, r = spec.hidden_size, spec.head_dim, par.tp, par.tp_rank
    c = f"model.layers.{layer}."
    out: list[Shard] = []
    ln1 = p + ("self_attention.linear_qkv.layer_norm_weight" if par.te_fused_norms else "input_layernorm.weight")
    out.append(replicated(ln1, c + "input_layernorm.weight", (h,), dtype))
    full = stack(qkv_rows(spec, layer))
    total = sum(s.rows for s in full)
    start, size = even(total, tp, r, "linear_qkv rows over tp")
    out += row_shards(p + "self_attention.linear_qkv.weight", (size, h), dtype, window(full, start, size), canon)
    if spec.qkv_bias:
        bias = window(stack(qkv_rows(spec, layer, "bias")), start, size)
        out += row_shards(p + "self_attention.linear_qkv.bias", (size,), dtype, bias, canon)
    if spec.qk_norm:
        out.append(replicated(p + "self_attention.q_layernorm.weight", c + "self_attn.q_norm.weight", (hd,), dtype))
        out.append(replicated(p + "self_attention.k_layernorm.weight", c + "self_attn.k_norm.weight", (hd,), dtype))
    cols_start, cols = even(spec.num_heads * hd, tp, r, "linear_proj columns over tp")
    out.append(col_shard(p + "self_attention.linear_proj.weight", (h, cols), dtype, c + "self_attn.o_proj.weight",
                         (h, spec.num_heads * hd), cols_start, cols))
    if spec.o_bias:   # RowParallelLinear bias: whole on every TP rank
        out.append(replicated(p + "self_attention.linear_proj.bias", c + "self_attn.o_proj.bias", (h,), dtype))
    moe = spec.is_moe_layer(layer)
    ln2 = p + ("mlp.linear_fc1.layer_norm_weight" if par.te_fused_norms and not moe else "pre_mlp_layernorm.weight")
    out.append(replicated(ln2, c + "post_attention_layernorm.weight", (h,), dtype))
    if not moe:
        out += _mlp(p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight", c + "mlp.", spec.intermediate_size,
                    h, tp, r, canon, dtype)
        return out
    out.append(replicated(p + "mlp.router.weight", c + "mlp.gate.weight", (spec.num_experts, h), dtype))
    first, local = even(spec.num_experts, par.ep, par.ep_rank, "num_experts over ep")
    etp = par.etp or tp
    etp_rank = r if par.etp_rank is None else par.etp_rank
    for i in range(local):
        if par.grouped_experts:
            fc1, fc2 = p + f"mlp.experts.linear_fc1.weight{i}", p + f"mlp.experts.linear_fc2.weight{i}"
        else:
            fc1 = p + f"mlp.experts.local_experts.{i}.linear_fc1.weight"
            fc2 = p + f"mlp.experts.local_experts.{i}.linear_fc2.weight"
        out += _mlp(fc1, fc2, c + f"mlp.experts.{first + i}.", spec.moe_intermediate_size, h, etp, etp_rank,
                    canon, dtype)
    return out


def _mlp(fc1: str, fc2: str, c: str, inter: int, h: int, tp: int, r: int, canon: dict[str, tuple[int, ...]],
         dtype: str) -> list[Shard]:
    start, size = even(inter, tp, r, "intermediate_size over tp")
    rows = stack([(c + "gate_proj.weight", start, size), (c + "up_proj.weight", start, size)])
    return [*row_shards(fc1, (2 * size, h), dtype, rows, canon),
            col_shard(fc2, (h, size), dtype, c + "down_proj.weight", (h, inter), start, size)]
