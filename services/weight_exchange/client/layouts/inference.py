"""vLLM and SGLang tensor-parallel layouts for Llama / Qwen2 / Qwen3 / Qwen3-MoE (their parameter names).

- `qkv_proj` = [q_r; k_r; v_r]: q heads split over TP; KV heads split when TP <= num_kv_heads, otherwise each
  rank holds KV head `tp_rank // (tp / num_kv_heads)` (replicated); `o_proj` split on dim 1.
- `gate_up_proj` = [gate_r; up_r]; `down_proj` split on dim 1.
- Vocab-parallel `embed_tokens` / `lm_head`: the vocabulary padded to a multiple of 64, then split over TP.
- Fused experts `w13_weight` [E_local, 2I/moe_tp, H] (gate half then up half) and `w2_weight`
  [E_local, H, I/moe_tp], with moe_tp = tp / ep, ep_rank = tp_rank // moe_tp (SGLang's rule; vLLM's expert
  parallelism is ep = tp).
"""

from __future__ import annotations

import dataclasses

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

ENGINES = ("vllm", "sglang")


@dataclasses.dataclass(frozen=True)
class InferenceParallel:
    tp: int = 1
    tp_rank: int = 0
    ep: int = 1                 # expert parallel size inside the TP group
    dp: int = 1                 # engine replicas (each holds a full TP copy)
    dp_rank: int = 0
    vocab_padding: int = 64
    engine: str = "vllm"

    def as_dict(self) -> dict[str, int]:
        return {"tp_size": self.tp, "tp_rank": self.tp_rank, "ep_size": self.ep, "dp_size": self.dp,
                "dp_rank": self.dp_rank}


def kv_heads(spec: ModelSpec, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) held by a TP rank, replicating KV heads when TP exceeds their number."""
    nkv = spec.num_kv_heads
    if tp >= nkv:
        if tp % nkv:
            raise ValueError(f"tp: {tp} is larger than num_key_value_heads {nkv} and not a multiple of it")
        return rank // (tp // nkv), 1
    return even(nkv, tp, rank, "num_key_value_heads over tp")


def inference_shards(spec: ModelSpec, par: InferenceParallel, dtype: str | None = None) -> list[Shard]:
    """Every shard one vLLM / SGLang TP rank holds."""
    if par.engine not in ENGINES:
        raise ValueError(f"engine: unknown {par.engine!r} (known: {', '.join(ENGINES)})")
    dtype = dtype or spec.dtype
    canon = spec.canonical()
    h, tp, r = spec.hidden_size, par.tp, par.tp_rank
    even(spec.num_heads, tp, r, "num_attention_heads over tp")
    padded = pad_to(spec.vocab_size, par.vocab_padding)
    shards = vocab_shard("model.embed_tokens.weight", "model.embed_tokens.weight", spec.vocab_size, h, padded, tp, r,
                         dtype)
    for layer in range(spec.num_layers):
        shards += _layer(spec, par, layer, canon, dtype)
    shards.append(replicated("model.norm.weight", "model.norm.weight", (h,), dtype))
    if not spec.tie_word_embeddings:
        shards += vocab_shard("lm_head.weight", "lm_head.weight", spec.vocab_size, h, padded, tp, r, dtype)
    return shards


def _layer(spec: ModelSpec, par: InferenceParallel, layer: int, canon: dict[str, tuple[int, ...]],
           dtype: str) -> list[Shard]:
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
    out.append(replicated(p + "mlp.gate.weight", p + "mlp.gate.weight", (spec.num_experts, h), dtype))
    if tp % par.ep:
        raise ValueError(f"ep: {par.ep} does not divide tp {tp}")
    moe_tp = tp // par.ep
    ep_rank, moe_rank = r // moe_tp, r % moe_tp
    e0, ne = even(spec.num_experts, par.ep, ep_rank, "num_experts over ep")
    i0, ni = even(spec.moe_intermediate_size, moe_tp, moe_rank, "moe_intermediate_size over tp/ep")
    w13, w2 = p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"
    for i in range(ne):
        c = p + f"mlp.experts.{e0 + i}."
        rows = stack([(c + "gate_proj.weight", i0, ni), (c + "up_proj.weight", i0, ni)])
        out += row_shards(w13, (ne, 2 * ni, h), dtype, rows, canon, lead=(i,))
        out.append(col_shard(w2, (ne, h, ni), dtype, c + "down_proj.weight", (h, spec.moe_intermediate_size),
                             i0, ni, lead=(i,)))
    return out
