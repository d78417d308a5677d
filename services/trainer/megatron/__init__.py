"""Megatron-core backend pieces: HF <-> Megatron weight conversion, GPTModel construction, vocab-parallel log-probs.

A backend rank, after `init_process_group` and `parallel_state.initialize_model_parallel(tp, pp, ep, etp)`:

    spec = model_spec(model_dir)                           # shapes in canonical (checkpoint) names
    par = model.current_parallel()                         # this rank's tp/pp/ep/etp/dp coordinates
    gpt = model.build_gpt_model(spec, par, rope_theta=..., norm_eps=..., moe_topk=...)
    gpt.load_state_dict(convert.hf_to_megatron(convert.canonical_state(hf_state, spec), spec, par), strict=True)
    logits = gpt(input_ids, position_ids, causal_mask)     # last stage: [B, T, V_padded / tp]
    logp = loss.vocab_parallel_logp(logits, targets, ps.get_tensor_model_parallel_group(), T, spec.vocab_size)
    # -> services.trainer.algorithms' losses (decoupled PPO ...) exactly as with the full-vocab token_logp

Export: gather every tp/pp/ep/etp rank's `gpt.state_dict()` (dp replicas may be left out) and call
`convert.megatron_to_hf(states, spec, side)`; the result is the checkpoint's tensors (safetensors-ready). The
weight exchange layout of a rank is `megatron_shards(spec, par)`, the same table the conversion follows.
Nothing here imports megatron-core at module load; `model` does, when its functions are called.
"""
