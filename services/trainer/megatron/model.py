"""A megatron-core GPTModel (local layer spec, no Transformer Engine) shaped like a Qwen/Llama-style HF model.

Call after `torch.distributed` and `megatron.core.parallel_state.initialize_model_parallel`; the model is
this rank's stage and shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.common.errors import FieldError
from services.trainer.megatron.convert import padded_vocab
from services.weight_exchange.client.layouts.megatron import MegatronParallel
from services.weight_exchange.client.layouts.model import ModelSpec


def current_parallel(vocab_divisor: int = 128, layers_per_stage: tuple[int, ...] | None = None) -> MegatronParallel:
    """This rank's coordinates as megatron-core's parallel_state assigned them (the layout the weights follow);
    ``layers_per_stage``: uneven pipeline stages (``layouts.megatron.pipeline_stages``)."""
    from megatron.core import parallel_state as ps

    return MegatronParallel(
        tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_world_size(), etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(), vocab_divisor=vocab_divisor,
        layers_per_stage=layers_per_stage)


def transformer_config(spec: ModelSpec, par: MegatronParallel, *, params_dtype: torch.dtype = torch.float32,
                       norm_eps: float = 1e-6, moe_topk: int = 2, moe_aux_loss_coeff: float = 0.0,
                       cpu_init: bool = True, **overrides):
    """The TransformerConfig whose GPTModel computes what the HF model computes (dropout off)."""
    from megatron.core.transformer import TransformerConfig

    moe = spec.num_experts > 0
    fields = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size,
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=norm_eps,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=cpu_init,
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp, expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp or par.tp,
        # megatron-core trains MoE layers under tensor parallelism only with sequence parallelism (the tokens
        # between the TP regions split over the TP ranks); dense models keep whole sequences
        sequence_parallel=moe and par.tp > 1,
        num_moe_experts=spec.num_experts if moe else None,
        moe_ffn_hidden_size=spec.moe_intermediate_size if moe else None, moe_router_topk=moe_topk,
        # Qwen3-MoE: softmax over all experts, top-k, renormalised == top-k then softmax (pre_softmax False)
        moe_router_pre_softmax=False, moe_router_load_balancing_type="none", moe_grouped_gemm=False,
        # megatron-core's all-gather dispatcher: its all-to-all one needs CUDA streams. It gathers equal shapes
        # over the expert group, so every rank of that group forwards the same [rows, length] (MegatronCausalLM)
        moe_token_dispatcher_type="allgather",
    )
    if moe and moe_aux_loss_coeff > 0:
        fields.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe_aux_loss_coeff)
    if moe and spec.num_experts % par.ep:
        raise FieldError("ep", f"{spec.num_experts} experts do not split evenly over ep {par.ep}")
    if not moe and par.ep > 1:
        raise FieldError("ep", f"expert parallelism needs a MoE model; {spec.num_experts} experts here")
    stages = par.layers_per_stage
    if stages is None and spec.num_layers % par.pp:
        raise FieldError("pp", f"{spec.num_layers} layers do not split evenly over {par.pp} stages (set "
                         "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage)")
    if stages is not None and len(set(stages)) > 1:
        # the layouts' stages, as Megatron's two settings: the middle stages then split the rest evenly alike
        fields.update(num_layers_in_first_pipeline_stage=stages[0], num_layers_in_last_pipeline_stage=stages[-1])
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(spec: ModelSpec, par: MegatronParallel | None = None, *, rope_theta: float = 10000.0,
                    max_sequence_length: int = 4096, **config_kwargs):
    """This rank's GPTModel; `par` defaults to parallel_state's coordinates."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _without_transformer_engine()
    par = par or current_parallel()
    if par.te_fused_norms or par.grouped_experts:
        raise FieldError("par", "the local layer spec has separate norms and per-expert MLPs")
    config = transformer_config(spec, par, **config_kwargs)
    moe = spec.num_experts > 0
    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts if moe else None, qk_layernorm=spec.qk_norm)
    if config.sequence_parallel:
        layer_spec = _sequence_parallel_norms(layer_spec, config, par.pp_rank)
    return GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=padded_vocab(spec, par),
                    max_sequence_length=max_sequence_length, pre_process=par.pp_rank == 0,
                    post_process=par.pp_rank == par.pp - 1,
                    share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope",
                    rotary_base=rope_theta)


def sequence_width(config, width: int) -> int:
    """The sequence length a forward pads to: with sequence parallelism, a multiple of the TP size (the sequence
    splits evenly over the TP ranks)."""
    if not config.sequence_parallel:
        return width
    tp = config.tensor_model_parallel_size
    return -(-width // tp) * tp


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """The local spec's norm (megatron-core's ``WrappedTorchNorm``) refuses sequence parallelism, which
    megatron-core requires for MoE layers under tensor parallelism. This one is the same ``torch.nn.RMSNorm`` with
    its weight marked ``sequence_parallel`` as megatron-core's own fused norms mark theirs: each TP rank sees a
    part of the sequence, so the weight's gradient is summed over the TP ranks (``ParallelGrads``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _sequence_parallel_norms(layer_spec, config, pp_rank: int):
    """The block of ``layer_spec`` layers with every norm (the layers', the attention's q / k, the final one) a
    ``SequenceParallelRMSNorm``."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    assert config.normalization == "RMSNorm", config.normalization
    attention = layer_spec.submodules.self_attention
    qk = {name: SequenceParallelRMSNorm for name in ("q_layernorm", "k_layernorm")
          if getattr(attention.submodules, name) is not IdentityOp}
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, **qk))
    layer = dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, input_layernorm=SequenceParallelRMSNorm, pre_mlp_layernorm=SequenceParallelRMSNorm,
        self_attention=attention))
    layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=SequenceParallelRMSNorm)


def _without_transformer_engine() -> None:
    """megatron-core 0.16's MoE router reads `te_general_gemm`, which it defines only when Transformer Engine
    imports; without TE every MoE forward raised NameError. None selects its plain torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
