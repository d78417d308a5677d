"""The engine's fast paths keep its outputs: greedy ids equal a plain step-by-step forward (fp32, with rows
admitted and dropped mid-batch), log-probs within 1e-4; the KV cache grows in place; prepacked linear layers see
in-place weight changes; the one-pass sampler gives the log-softmax log-prob of the token it draws."""

from __future__ import annotations

import torch

from services.common.cpu_features import onednn_linear
from services.rollout.engines.runner import ModelRunner, PackedLinears, SlackLayer
from services.rollout.engines.sampler import sample
from services.rollout.engines.scheduler import Scheduler
from services.rollout.engines.sequence import Sampling, Sequence
from tests.rollout.test_engine import full_forward_logprobs, tiny_model
from tests.rollout.test_runner import run_to_end


def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_ids_equal_a_plain_forward_with_admissions_and_compaction():
    model = tiny_model(7)
    reference = tiny_model(7)  # never packed: the plain HF path
    scheduler = Scheduler(max_batch=4, eos_token_id=-1, max_context=256, refill_fraction=0.25)
    runner = ModelRunner(model, pad_token_id=0, seed=0)
    g = torch.Generator().manual_seed(3)
    lengths = (5, 12, 3, 9, 17, 2, 7, 30)
    seqs = [Sequence(prompt_ids=torch.randint(2, 64, (n,), generator=g).tolist(),
                     sampling=Sampling(temperature=0.0, max_new_tokens=6 + 11 * (i % 3)))
            for i, n in enumerate(lengths)]
    run_to_end(scheduler, runner, {0: seqs[:3], 4: seqs[3:6], 9: seqs[6:]})
    assert runner.packed is not None and runner.packed.layers, "the fast path ran"
    for s in seqs:
        assert s.output_ids == plain_greedy(reference, s.prompt_ids, len(s.output_ids))
        torch.testing.assert_close(torch.tensor(s.logprobs), full_forward_logprobs(reference, s.prompt_ids, s.output_ids),
                                   atol=1e-4, rtol=1e-4)


def test_kv_cache_grows_in_place_between_reallocations():
    model = tiny_model(1)
    runner = ModelRunner(model, pad_token_id=0, seed=0)
    scheduler = Scheduler(max_batch=4, eos_token_id=-1, max_context=256)
    for n in (4, 6):
        scheduler.add(Sequence(prompt_ids=list(range(2, 2 + n)), sampling=Sampling(temperature=1.0, max_new_tokens=40)))
    buffers = []
    for _ in range(40):
        step = scheduler.schedule()
        scheduler.postprocess(step.rows, *runner.run(step), version=0)
        layer = runner._cache.layers[0]
        assert type(layer) is SlackLayer
        buffers.append(layer._kbuf.data_ptr() if layer._kbuf is not None else None)
        if layer._kbuf is not None:
            assert layer.keys.data_ptr() == layer._kbuf.data_ptr() and layer.keys.shape[-2] <= layer._kbuf.shape[-2]
    assert len(set(buffers)) <= 3, "a handful of reallocations in 40 steps, not one per step"


def test_packed_linears_follow_in_place_weight_changes_and_unpack():
    assert onednn_linear(), "every x86-64 torch build has oneDNN's prepacked linear"
    model, reference = tiny_model(2), tiny_model(2)
    packed = PackedLinears(model)
    ids = torch.randint(2, 60, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            a.mul_(1.5)
            b.mul_(1.5)
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    packed.unpack()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_one_pass_sampler_returns_the_log_softmax_logprob_of_its_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=g) * 4
    temperature = torch.tensor([1.0, 0.7, 0.0, 2.5] * 16)
    ones, no_k = torch.ones(64), torch.zeros(64, dtype=torch.long)
    for temp in (torch.ones(64), temperature, torch.zeros(64)):
        tokens, logprobs = sample(logits, temp, ones, no_k, g)
        safe = torch.where(temp <= 0, torch.ones_like(temp), temp)
        expected = torch.log_softmax(logits / safe[:, None], -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
        greedy = temp <= 0
        assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    # bf16 logits: the log-prob is still computed in float32
    tokens, logprobs = sample(logits.bfloat16(), torch.ones(64), ones, no_k, g)
    assert logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


async def test_weights_written_as_raw_bytes_take_effect_after_resume_with_a_version():
    """The weight sync's direct transports (TCP recv_into, process_vm_readv) write the parameters' memory without
    torch seeing it: resume(version) must rebuild the prepacked copies."""
    import asyncio

    from tests.rollout.test_engine import make_engine

    model = tiny_model(8)
    new = {k: v.clone() for k, v in tiny_model(9).state_dict().items()}
    engine = make_engine(model, eos_token_id_override=-1)
    sampling = Sampling(temperature=1.0, max_new_tokens=8)
    try:
        await asyncio.wait_for(engine.generate([4, 5, 6], sampling), 60)  # packs the old weights
        await engine.pause_async(timeout=30)
        for name, param in engine.named_parameters().items():
            versions = param._version
            param.detach().numpy()[...] = new[name].numpy()  # raw bytes: no version-counter bump
            assert param._version == versions
        await engine.resume_async(version=1)
        [after] = await asyncio.wait_for(engine.generate([4, 5, 6], sampling), 60)
    finally:
        engine.stop()
    reference = tiny_model(9)
    torch.testing.assert_close(torch.tensor(after.logprobs), full_forward_logprobs(reference, [4, 5, 6], after.output_ids),
                               atol=1e-4, rtol=1e-4)
