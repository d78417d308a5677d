"""Build a real megatron-core GPTModel on CPU (gloo, use_cpu_initialization) and dump its parameter shapes.

`python -m tests.weight_exchange.megatron_proc --rank R --world W --store FILE --out DIR --tp T --pp P --ep E
 --etp X --model NAME [--first N] [--last N] [--vocab-div D | --unpadded]`: writes DIR/rank<R>.json =
{"parallel": {...}, "params": {name: shape}, "layers": [global layer index of each local layer]}.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import torch.nn.functional as F

from tests.ranks import join_cpu_group, leave_cpu_group


def main() -> None:
    ap = argparse.ArgumentParser()
    for k in ("rank", "world", "tp", "pp", "ep", "etp"):
        ap.add_argument(f"--{k}", type=int, default=1)
    for k in ("first", "last"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--vocab-div", type=int, default=128, help="make_vocab_size_divisible_by")
    ap.add_argument("--unpadded", action="store_true", help="the vocabulary as is (Megatron-Bridge exports)")
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--out", required=True)
    ap.add_argument("--store", required=True, help="a file every rank names: the rendezvous (no port to race for)")
    a = ap.parse_args()
    join_cpu_group(a.rank, a.world, a.store)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from services.weight_exchange.client.layouts.common import pad_to
    from services.weight_exchange.client.layouts.model import model_spec

    ps.initialize_model_parallel(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                                 expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    spec = model_spec(a.model)
    moe = spec.num_experts > 0
    config = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp, expert_model_parallel_size=a.ep,
        expert_tensor_parallel_size=a.etp, sequence_parallel=False,
        num_moe_experts=spec.num_experts if moe else None,
        moe_ffn_hidden_size=spec.moe_intermediate_size if moe else None, moe_router_topk=2 if moe else 2,
        moe_grouped_gemm=False,
        num_layers_in_first_pipeline_stage=a.first, num_layers_in_last_pipeline_stage=a.last,
    )
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts if moe else None, qk_layernorm=spec.qk_norm)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                     vocab_size=spec.vocab_size if a.unpadded else pad_to(spec.vocab_size, a.vocab_div * a.tp),
                     max_sequence_length=128,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope")
    parallel = {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
                "ep_rank": ps.get_expert_model_parallel_rank(), "etp_rank": ps.get_expert_tensor_parallel_rank(),
                "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size()}
    params = {n: list(p.shape) for n, p in model.named_parameters()}
    layers = [layer.layer_number - 1 for layer in model.decoder.layers]   # Megatron numbers layers from 1
    pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(a.out) / f"rank{a.rank}.json").write_text(json.dumps({"parallel": parallel, "params": params,
                                                                        "layers": layers}))
    leave_cpu_group()


if __name__ == "__main__":
    main()
