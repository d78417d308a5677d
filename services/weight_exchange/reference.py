"""The Hugging Face reference and each framework's sharding rule, written independently of the layouts.

These follow how the frameworks load a checkpoint (torch chunk / narrow / cat, as in Megatron converters
and vLLM / SGLang weight_loaders), not the region arithmetic of the layouts, so comparing a receiver's
tensors with them checks layouts, planner and transports together (tests and the benchmark's `correct`).
"""

from __future__ import annotations

import torch

from services.weight_exchange.client.layouts.megatron import stage_layers
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
    par = megatron_parallel(side, rank, spec.num_layers)
    tp, r = par.tp, par.tp_rank
    hd, ng = spec.head_dim, spec.num_kv_heads
    qpg = spec.num_heads // ng
    out: dict[str, torch.Tensor] = {}
    padded = spec.vocab_size if par.vocab_unpadded else _ceil(spec.vocab_size, par.vocab_divisor * tp)
    if par.pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _pad_rows(ref["model.embed_tokens.weight"], padded).chunk(tp)[r]
    for i, layer in enumerate(stage_layers(spec, par)):
        c, m = f"model.layers.{layer}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = ref[c + "input_layernorm.weight"]
        for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (ref[c + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
            rest = q.shape[1:]
            fused = torch.cat([q.reshape(ng, qpg * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], 1)
            out[m + f"self_attention.linear_qkv.{suffix}"] = fused.reshape(-1, *rest).chunk(tp)[r]
        out[m + "self_attention.linear_proj.weight"] = ref[c + "self_attn.o_proj.weight"].chunk(tp, 1)[r]
        if spec.o_bias:
            out[m + "self_attention.linear_proj.bias"] = ref[c + "self_attn.o_proj.bias"]
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


def _vllm_experts(spec: ModelSpec, side: Side, tp_rank: int, edp_rank: int) -> tuple[int, int, list[int]]:
    """(MoE tp size, MoE tp rank, global experts) of a rank, as vLLM's FusedMoE / SGLang's EP MoE place them."""
    tp, ep, edp = side.get("tp"), side.get("ep"), side.get("edp")
    if side.framework == "sglang":
        moe_tp = tp // ep
        local = spec.num_experts // ep
        return moe_tp, tp_rank % moe_tp, list(range(tp_rank // moe_tp * local, (tp_rank // moe_tp + 1) * local))
    flat = edp_rank * tp + tp_rank     # vLLM flattens tp over the engine's data-parallel ranks
    if ep == 1:
        return tp * edp, flat, list(range(spec.num_experts))
    owner = [-1] * spec.num_experts     # expert -> ep rank, like determine_expert_map
    if "rr" in side.sizes:
        for e in range(spec.num_experts):
            owner[e] = e % ep
    else:
        counts = [spec.num_experts // ep + (1 if k < spec.num_experts % ep else 0) for k in range(ep)]
        e = 0
        for k, n in enumerate(counts):
            for _ in range(n):
                owner[e] = k
                e += 1
    return 1, 0, [e for e in range(spec.num_experts) if owner[e] == flat]


def vllm_local(spec: ModelSpec, side: Side, rank: int, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM / SGLang weight_loaders leave in a TP rank after loading the checkpoint (vLLM-Ascend: then
    transposes the fused experts)."""
    tp = side.get("tp")
    r, edp_rank = rank % tp, (rank // tp) % side.get("edp")
    hd = spec.head_dim
    q_size = spec.num_heads // tp * hd
    if tp >= spec.num_kv_heads:
        replicas, kv_size = tp // spec.num_kv_heads, hd
    else:
        replicas, kv_size = 1, spec.num_kv_heads // tp * hd
    kv_rank = r // replicas
    per = _ceil(spec.vocab_size, side.sizes.get("vocab_pad", 64)) // tp
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
        if spec.o_bias:
            out[c + "self_attn.o_proj.bias"] = ref[c + "self_attn.o_proj.bias"]
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
        moe_tp, mr, experts = _vllm_experts(spec, side, r, edp_rank)
        n = spec.moe_intermediate_size // moe_tp
        w13, w2 = [], []
        for g in experts:
            e = f"{c}mlp.experts.{g}."
            w13.append(torch.cat([ref[e + "gate_proj.weight"].narrow(0, mr * n, n),
                                  ref[e + "up_proj.weight"].narrow(0, mr * n, n)]))
            w2.append(ref[e + "down_proj.weight"].narrow(1, mr * n, n))
        out[c + "mlp.experts.w13_weight"] = torch.stack(w13)
        out[c + "mlp.experts.w2_weight"] = torch.stack(w2)
        if side.framework == "vllm_ascend":   # process_weights_after_loading: [E, H, 2I] and [E, I, H]
            for key in ("mlp.experts.w13_weight", "mlp.experts.w2_weight"):
                out[c + key] = out[c + key].transpose(1, 2).contiguous()
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
