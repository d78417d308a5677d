"""The Hugging Face reference and each framework's sharding rule, written independently of the layouts.

These follow how the frameworks load a checkpoint (torch chunk / narrow / cat, as in Megatron converters
and vLLM / SGLang weight_loaders), not the region arithmetic of the layouts, so comparing a receiver's
tensors with them checks layouts, planner and transports together (tests and the benchmark's `correct`).
"""

from __future__ import annotations

import torch

from services.weight_exchange.client.layouts.model import ModelSpec
from services.weight_exchange.client.layouts.topology import Side, megatron_parallel


def hf_reference(spec: ModelSpec, seed: int, dtype: torch.dtype, fast: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic random weights in the checkpoint namespace (any process rebuilds the same tensors).

    `fast`: random bytes instead of normal values (for large benchmark models; bit patterns may be NaN).
    """
    out = {}
    for i, (name, shape) in enumerate(spec.canonical().items()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        if fast:
            n = 1
            for s in shape:
                n *= s
            raw = torch.randint(-(2 ** 31), 2 ** 31 - 1, ((n * dtype.itemsize + 3) // 4,), generator=g,
                                dtype=torch.int32)
            out[name] = raw.view(torch.uint8)[:n * dtype.itemsize].view(dtype).reshape(shape)
        else:
            out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _ceil(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def megatron_local(spec: ModelSpec, side: Side, rank: int, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    par = megatron_parallel(side, rank)
    tp, r = par.tp, par.tp_rank
    hd, ng = spec.head_dim, spec.num_kv_heads
    qpg = spec.num_heads // ng
    out: dict[str, torch.Tensor] = {}
    padded = _ceil(spec.vocab_size, 128 * tp)
    per_stage = spec.num_layers // par.pp
    if par.pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _pad_rows(ref["model.embed_tokens.weight"], padded).chunk(tp)[r]
    for i in range(per_stage):
        layer = par.pp_rank * per_stage + i
        c, m = f"model.layers.{layer}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = ref[c + "input_layernorm.weight"]
        for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (ref[c + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
            rest = q.shape[1:]
            fused = torch.cat([q.reshape(ng, qpg * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], 1)
            out[m + f"self_attention.linear_qkv.{suffix}"] = fused.reshape(-1, *rest).chunk(tp)[r]
        out[m + "self_attention.linear_proj.weight"] = ref[c + "self_attn.o_proj.weight"].chunk(tp, 1)[r]
        if spec.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = ref[c + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = ref[c + "self_attn.k_norm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = ref[c + "post_attention_layernorm.weight"]
        if not spec.is_moe_layer(layer):
            out[m + "mlp.linear_fc1.weight"] = torch.cat([ref[c + "mlp.gate_proj.weight"].chunk(tp)[r],
                                                          ref[c + "mlp.up_proj.weight"].chunk(tp)[r]])
            out[m + "mlp.linear_fc2.weight"] = ref[c + "mlp.down_proj.weight"].chunk(tp, 1)[r]
            continue
        out[m + "mlp.router.weight"] = ref[c + "mlp.gate.weight"]
        local = spec.num_experts // par.ep
        etp, er = par.etp or tp, par.etp_rank if par.etp_rank is not None else r
        for j in range(local):
            e = f"{c}mlp.experts.{par.ep_rank * local + j}."
            x = f"{m}mlp.experts.local_experts.{j}."
            out[x + "linear_fc1.weight"] = torch.cat([ref[e + "gate_proj.weight"].chunk(etp)[er],
                                                      ref[e + "up_proj.weight"].chunk(etp)[er]])
            out[x + "linear_fc2.weight"] = ref[e + "down_proj.weight"].chunk(etp, 1)[er]
    if par.pp_rank == par.pp - 1:
        out["decoder.final_layernorm.weight"] = ref["model.norm.weight"]
        if not spec.tie_word_embeddings or par.pp > 1:
            head = ref["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
            out["output_layer.weight"] = _pad_rows(head, padded).chunk(tp)[r]
    return out


def vllm_local(spec: ModelSpec, side: Side, rank: int, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM / SGLang weight_loaders leave in a TP rank after loading the checkpoint."""
    tp, ep = side.get("tp"), side.get("ep")
    r = rank % tp
    hd = spec.head_dim
    q_size = spec.num_heads // tp * hd
    if tp >= spec.num_kv_heads:
        replicas, kv_size = tp // spec.num_kv_heads, hd
    else:
        replicas, kv_size = 1, spec.num_kv_heads // tp * hd
    kv_rank = r // replicas
    per = _ceil(spec.vocab_size, 64) // tp
    out = {"model.embed_tokens.weight": _pad_rows(ref["model.embed_tokens.weight"], per * tp)[r * per:(r + 1) * per]}
    for layer in range(spec.num_layers):
        c = f"model.layers.{layer}."
        out[c + "input_layernorm.weight"] = ref[c + "input_layernorm.weight"]
        for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (ref[c + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
            out[c + f"self_attn.qkv_proj.{suffix}"] = torch.cat([
                q.narrow(0, r * q_size, q_size), k.narrow(0, kv_rank * kv_size, kv_size),
                v.narrow(0, kv_rank * kv_size, kv_size)])
        out[c + "self_attn.o_proj.weight"] = ref[c + "self_attn.o_proj.weight"].narrow(1, r * q_size, q_size)
        if spec.qk_norm:
            out[c + "self_attn.q_norm.weight"] = ref[c + "self_attn.q_norm.weight"]
            out[c + "self_attn.k_norm.weight"] = ref[c + "self_attn.k_norm.weight"]
        out[c + "post_attention_layernorm.weight"] = ref[c + "post_attention_layernorm.weight"]
        if not spec.is_moe_layer(layer):
            n = spec.intermediate_size // tp
            out[c + "mlp.gate_up_proj.weight"] = torch.cat([ref[c + "mlp.gate_proj.weight"].narrow(0, r * n, n),
                                                            ref[c + "mlp.up_proj.weight"].narrow(0, r * n, n)])
            out[c + "mlp.down_proj.weight"] = ref[c + "mlp.down_proj.weight"].narrow(1, r * n, n)
            continue
        out[c + "mlp.gate.weight"] = ref[c + "mlp.gate.weight"]
        moe_tp = tp // ep
        ep_rank, mr = r // moe_tp, r % moe_tp
        local = spec.num_experts // ep
        n = spec.moe_intermediate_size // moe_tp
        w13, w2 = [], []
        for j in range(local):
            e = f"{c}mlp.experts.{ep_rank * local + j}."
            w13.append(torch.cat([ref[e + "gate_proj.weight"].narrow(0, mr * n, n),
                                  ref[e + "up_proj.weight"].narrow(0, mr * n, n)]))
            w2.append(ref[e + "down_proj.weight"].narrow(1, mr * n, n))
        out[c + "mlp.experts.w13_weight"] = torch.stack(w13)
        out[c + "mlp.experts.w2_weight"] = torch.stack(w2)
    out["model.norm.weight"] = ref["model.norm.weight"]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = _pad_rows(ref["lm_head.weight"], per * tp)[r * per:(r + 1) * per]
    return out


def fsdp2_local(spec: ModelSpec, side: Side, rank: int, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dp = side.get("dp")
    return {name: t.chunk(dp)[rank] if rank < len(t.chunk(dp)) else t[:0] for name, t in ref.items()}


def local_tensors(spec: ModelSpec, side: Side, rank: int, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's local tensors (contiguous copies) by the framework's own loading rule."""
    fw = side.framework
    if fw in ("hf", "embedded"):
        out = dict(ref)
    elif fw == "fsdp2":
        out = fsdp2_local(spec, side, rank, ref)
    elif fw == "megatron":
        out = megatron_local(spec, side, rank, ref)
    else:
        out = vllm_local(spec, side, rank, ref)
    return {k: v.contiguous().clone() for k, v in out.items()}
