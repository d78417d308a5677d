"""The embedded engine: batched generation, per-token versions, interruption with KV rebuild."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EmbeddedEngine

VOCAB = 64
EOS = 1


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3ForCausalLM(config).eval()


def make_engine(model, **kw) -> EmbeddedEngine:
    eos = kw.pop("eos_token_id_override", EOS)
    engine = EmbeddedEngine(model, eos_token_id=eos, pad_token_id=0, max_batch=kw.pop("max_batch", 8),
                            max_context=256, seed=0, **kw)
    engine.start()
    return engine


def full_forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return logp.gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1)


async def test_batched_generation_logprobs_match_full_forward():
    model = tiny_model(0)
    engine = make_engine(model)
    try:
        sampling = Sampling(temperature=1.0, max_new_tokens=12, stop_token_ids=())
        prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14, 15]]
        results = await asyncio.wait_for(asyncio.gather(*(engine.generate(p, sampling, n=2) for p in prompts)), 60)
    finally:
        engine.stop()
    for prompt, seqs in zip(prompts, results, strict=True):
        for seq in seqs:
            assert 1 <= len(seq.output_ids) <= 12
            assert len(seq.logprobs) == len(seq.versions) == len(seq.output_ids)
            assert set(seq.versions) == {0}
            expected = full_forward_logprobs(model, prompt, seq.output_ids)
            torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=1e-4)


async def test_greedy_is_deterministic_and_matches_argmax():
    model = tiny_model(1)
    engine = make_engine(model)
    try:
        sampling = Sampling(temperature=0.0, max_new_tokens=8)
        a, b = await asyncio.gather(engine.generate([3, 4, 5], sampling), engine.generate([3, 4, 5], sampling))
    finally:
        engine.stop()
    assert a[0].output_ids == b[0].output_ids
    ids = [3, 4, 5]
    for token in a[0].output_ids:
        with torch.no_grad():
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        assert token == nxt
        ids.append(token)


async def test_weight_update_mid_generation_interrupts_and_rebuilds_kv():
    model = tiny_model(2)
    new_weights = {k: v.clone() for k, v in tiny_model(3).state_dict().items()}
    engine = make_engine(model, eos_token_id_override=-1)  # no EOS: the sequences run until max_new_tokens
    sampling = Sampling(temperature=1.0, max_new_tokens=120, stop_token_ids=())
    try:
        task = asyncio.ensure_future(engine.generate([7, 8, 9], sampling, n=3))
        async with asyncio.timeout(30):
            while engine.stats.tokens_generated < 30:
                await asyncio.sleep(0.005)
        await engine.pause_async(timeout=30)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(new_weights[name])
        await engine.resume_async(version=1)
        seqs = await asyncio.wait_for(task, 60)
    finally:
        engine.stop()
    assert engine.stats.weight_updates == 1
    for seq in seqs:
        assert seq.versions[0] == 0 and seq.versions[-1] == 1, "tokens of both versions"
        assert seq.versions == sorted(seq.versions)
        cut = seq.versions.index(1)
        expected = full_forward_logprobs(model, [7, 8, 9] + seq.output_ids[:cut], seq.output_ids[cut:])
        torch.testing.assert_close(torch.tensor(seq.logprobs[cut:]), expected, atol=1e-4, rtol=1e-4)


def test_pause_blocks_generation_until_resume():
    model = tiny_model(4)
    engine = make_engine(model)
    try:
        engine.pause()
        done = threading.Event()
        engine.submit([5, 6], Sampling(temperature=1.0, max_new_tokens=4), lambda seq: done.set())
        assert not done.wait(0.5), "no token may be generated while paused"
        engine.resume()
        assert done.wait(30)
    finally:
        engine.stop()


def test_abort_stops_a_running_sequence_early_frees_its_slot_and_calls_back_once():
    model = tiny_model(5)
    engine = make_engine(model, eos_token_id_override=-1, max_batch=1)  # no EOS; one slot
    finished: list = []
    sampling = Sampling(temperature=1.0, max_new_tokens=200)
    try:
        running = engine.submit([5, 6, 7], sampling, finished.append)
        waiting = engine.submit([8, 9], sampling, finished.append)
        engine.abort(waiting)
        assert finished == [waiting] and waiting.finish_reason == "abort" and waiting.output_ids == []
        for _ in range(3000):
            if len(running.output_ids) >= 5:
                break
            threading.Event().wait(0.01)
        engine.abort(running)
        ids_at_abort = list(running.output_ids)
        later = engine.submit([10, 11], Sampling(temperature=1.0, max_new_tokens=4), finished.append)
        for _ in range(3000):
            if later in finished:
                break
            threading.Event().wait(0.01)
        engine.abort(running)  # already finished: nothing happens
    finally:
        engine.stop()
    assert finished == [waiting, running, later], "each callback fires exactly once; the freed slot serves the next"
    assert running.finish_reason == "abort" and 5 <= len(running.output_ids) < 200
    assert running.output_ids == ids_at_abort, "no token is appended after abort() returns"
    assert len(running.logprobs) == len(running.versions) == len(running.output_ids)
    assert later.finish_reason == "length" and len(later.output_ids) == 4
    assert engine.stats.sequences_aborted == 2 and engine.stats.sequences_finished == 3
    assert engine.stats.tokens_generated == len(running.output_ids) + 4


def test_bad_sampling_names_the_field():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampling(max_new_tokens=0)
