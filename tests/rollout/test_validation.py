"""Every edge of the rollout refuses what cannot run before it is admitted, and a failing model step ends only
the rows it fails on: one bad request never aborts another request's sequences."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.rollout.config import RolloutConfig
from services.rollout.engines.base import MAX_SAMPLES
from services.rollout.engines.sequence import Sampling, Sequence
from services.rollout.engines.torch_engine import EmbeddedEngine
from services.rollout.server import Rollout
from services.rollout.workflows.single_turn import validate_work

VOCAB = 64


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture
def engine():
    torch.set_num_threads(1)
    engine = EmbeddedEngine(tiny_model(), eos_token_id=1, pad_token_id=0, max_batch=8, max_context=64, seed=0)
    engine.start()
    yield engine
    engine.stop()


@pytest.mark.parametrize("prompt, sampling, n, field", [
    ([5, VOCAB], Sampling(), 1, "prompt_ids"),
    ([5, -1], Sampling(), 1, "prompt_ids"),
    ([], Sampling(), 1, "prompt_ids"),
    ([5] * 64, Sampling(), 1, "prompt_ids"),
    ([5], Sampling(max_new_tokens=65), 1, "max_new_tokens"),
    ([5], Sampling(stop_token_ids=(VOCAB + 3,)), 1, "stop_token_ids"),
    ([5], Sampling(), 0, "n"),
    ([5], Sampling(), MAX_SAMPLES + 1, "n"),
])
def test_the_engine_refuses_what_cannot_run_before_admitting_it(engine, prompt, sampling, n, field):
    with pytest.raises(ValueError, match=field):
        engine.check(prompt, sampling, n)
    with pytest.raises(ValueError, match=field):
        asyncio.run(engine.generate(prompt, sampling, n=n))
    assert engine.scheduler.num_waiting == 0 and not engine.scheduler.running


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"), ({"temperature": 11.0}, "temperature"),
    ({"top_p": math.nan}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_k": 10**30}, "top_k"),
    ({"top_k": -1}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop_token_ids": (-2,)}, "stop_token_ids"),
])
def test_sampling_parameters_must_be_finite_and_in_their_documented_ranges(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Sampling(**kwargs)


async def test_a_row_the_model_step_fails_on_ends_alone_and_the_others_finish(engine):
    """An out-of-range id smuggled past the checks (straight into the scheduler) fails the shared step: only its
    row ends ("error"); the other rows continue and their log-probs are still those of a full forward."""
    loop = asyncio.get_running_loop()
    sampling = Sampling(temperature=1.0, max_new_tokens=10)
    good = asyncio.ensure_future(engine.generate([5, 6, 7], sampling, n=3))
    await asyncio.sleep(0.05)
    done = loop.create_future()
    bad = Sequence(prompt_ids=[5, VOCAB + 100], sampling=sampling,
                   on_finish=lambda s: loop.call_soon_threadsafe(done.set_result, s))
    with engine._cv:
        engine.scheduler.add(bad)
        engine._cv.notify_all()
    seqs = await asyncio.wait_for(good, 60)
    failed = await asyncio.wait_for(done, 60)
    assert failed.finish_reason == "error"
    assert [s.finish_reason for s in seqs] != [] and all(s.finish_reason in ("stop", "length") for s in seqs)
    assert engine.stats.sequences_failed == 1 and engine.stats.steps_failed >= 1
    model = engine.model
    for seq in seqs:
        ids = torch.tensor([[5, 6, 7] + seq.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, 2:-1].float(), -1)
        expected = logp.gather(-1, torch.tensor(seq.output_ids).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=1e-4)
    after = await asyncio.wait_for(engine.generate([9, 10], sampling, n=2), 60)  # the engine goes on
    assert all(s.finish_reason in ("stop", "length") for s in after)


async def test_a_vanishing_temperature_samples_safely_beside_other_rows(engine):
    tiny = asyncio.ensure_future(engine.generate([5, 6], Sampling(temperature=1e-38, max_new_tokens=6), n=2))
    normal = asyncio.ensure_future(engine.generate([7, 8], Sampling(temperature=1.0, max_new_tokens=6), n=2))
    for seqs in await asyncio.wait_for(asyncio.gather(tiny, normal), 60):
        assert all(s.finish_reason in ("stop", "length") and all(math.isfinite(x) for x in s.logprobs) for s in seqs)
    assert engine.stats.steps_failed == 0


def work(**kw) -> data_pb2.PromptWork:
    base = dict(work_id="w-1", group_id="g-1", task_id="t", prompt_ids=[5, 6], group_size=2, split="train",
                sampling=data_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4))
    base.update(kw)
    return data_pb2.PromptWork(**base)


@pytest.mark.parametrize("bad, field", [
    ({"work_id": ""}, "work_id"), ({"work_id": "a b"}, "work_id"), ({"work_id": "x\r\nNats-Msg-Id: y"}, "work_id"),
    ({"group_id": ""}, "group_id"), ({"group_id": "x\r\nNats-Msg-Id: y"}, "group_id"),
    ({"prompt_ids": []}, "prompt_ids"), ({"prompt_ids": [5, VOCAB]}, "prompt_ids"),
    ({"prompt_ids": [-4]}, "prompt_ids"), ({"group_size": 0}, "group_size"), ({"group_size": 10**6}, "group_size"),
    ({"split": "test"}, "split"),
    ({"sampling": data_pb2.SamplingParams(temperature=math.nan, max_new_tokens=4)}, "temperature"),
    ({"sampling": data_pb2.SamplingParams(temperature=1.0, max_new_tokens=0)}, "max_new_tokens"),
    ({"sampling": data_pb2.SamplingParams(temperature=1.0, max_new_tokens=4, top_k=-3)}, "top_k"),
])
def test_bad_prompt_work_is_an_invalid_message_naming_the_field(engine, bad, field):
    with pytest.raises(InvalidMessage, match=field):
        validate_work(work(**bad), engine)


class Published:
    max_payload = 1 << 20

    def __init__(self) -> None:
        self.messages: list = []

    async def publish(self, subject, message, msg_id, **_):
        self.messages.append((subject, message, msg_id))
        return True


async def test_the_consumer_handler_refuses_bad_work_before_admission_and_runs_good_work(engine):
    bus = Published()
    rollout = Rollout(RolloutConfig(), engine, bus)
    with pytest.raises(InvalidMessage, match="prompt_ids"):
        await rollout.handle_work(work(prompt_ids=[3, VOCAB + 7]))
    assert engine.stats.sequences_finished == 0 and engine.stats.steps == 0
    await asyncio.wait_for(rollout.handle_work(work()), 60)
    ((subject, group, _),) = bus.messages  # the group, as one message
    assert subject == "traj.raw" and [t.trajectory_id for t in group.trajectories] == ["w-1-0", "w-1-1"]
