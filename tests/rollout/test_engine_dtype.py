"""`engine.dtype`: float32 by default; bfloat16 puts the weights and the KV cache in bf16 while log-probs are
still computed in float32 from the logits; a weight update into a bf16 engine (float32 tensors copied into its
parameters, as the weight sync's receiver does) takes effect at the next step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig
from tests.rollout.test_engine import full_forward_logprobs, make_engine, tiny_model


def test_float32_is_the_default_and_other_dtypes_are_refused():
    assert EngineConfig().dtype == "float32"
    with pytest.raises(ValueError, match="engine.dtype"):
        EngineConfig(dtype="float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_built_engine_holds_weights_and_kv_in_its_dtype(dtype, tiny_qwen3):
    engine = EngineConfig(model_path=str(tiny_qwen3), dtype=dtype, max_batch=8, max_context=128).build()
    engine.start()
    try:
        [seq] = await asyncio.wait_for(engine.generate([5, 6, 7, 8], Sampling(temperature=1.0, max_new_tokens=6)), 60)
        kv = engine.runner._cache.layers[0].keys
    finally:
        engine.stop()
    want = getattr(torch, dtype)
    assert {p.dtype for p in engine.named_parameters().values()} == {want}
    assert kv.dtype == want
    assert all(isinstance(x, float) for x in seq.logprobs)


async def test_bf16_logprobs_match_a_float32_softmax_of_the_bf16_logits_and_updates_land():
    model = tiny_model(4).to(torch.bfloat16)
    new_weights = {k: v.clone() for k, v in tiny_model(5).state_dict().items()}  # float32, as the trainer sends
    engine = make_engine(model, eos_token_id_override=-1)
    sampling = Sampling(temperature=1.0, max_new_tokens=10)
    try:
        [before] = await asyncio.wait_for(engine.generate([3, 4, 5], sampling), 60)
        await engine.pause_async(timeout=30)
        with torch.no_grad():
            for name, param in engine.named_parameters().items():
                param.copy_(new_weights[name])  # cast on receipt
        await engine.resume_async(version=1)
        [after] = await asyncio.wait_for(engine.generate([3, 4, 5], sampling), 60)
    finally:
        engine.stop()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert set(before.versions) == {0} and set(after.versions) == {1}
    # the reference: the same bf16 model's logits, soft-maxed in float32 (batched vs single-row bf16 matmuls
    # round differently, hence the bf16-sized tolerance)
    for seq in (after,):
        expected = full_forward_logprobs(model, [3, 4, 5], seq.output_ids)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=0.05, rtol=0.02)
    reference = tiny_model(5).to(torch.bfloat16)
    expected = full_forward_logprobs(reference, [3, 4, 5], after.output_ids)
    torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=0.05, rtol=0.02)


async def test_prepack_off_runs_the_plain_layers_with_the_same_greedy_ids(tiny_qwen3):
    sampling = Sampling(temperature=0.0, max_new_tokens=8)
    outputs = []
    for prepack in (False, True):
        engine = EngineConfig(model_path=str(tiny_qwen3), max_batch=8, max_context=128, prepack=prepack).build()
        engine.start()
        try:
            [seq] = await asyncio.wait_for(engine.generate([5, 6, 7, 8], sampling), 60)
        finally:
            engine.stop()
        assert (engine.runner.packed is not None) == prepack
        assert all("forward" not in m.__dict__ for m in engine.model.modules()) == (not prepack)
        outputs.append(seq.output_ids)
    assert outputs[0] == outputs[1]
