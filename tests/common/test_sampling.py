"""A trajectory carries the sampling it was generated with; the builder and the trainer refuse one sampled at a
temperature other than the run's (the trainer's log-prob ratios would be wrong)."""

from __future__ import annotations

import pytest

from services.builder.config import BuilderConfig
from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.common.sampling import MIXED_TEMPERATURE, path_sampling, temperature_mismatch
from services.rollout.workflows.single_turn import to_trajectories
from services.trainer.batching import pack
from tests.builder.test_flush_reliability import FakeMsg, recovered, shut, traj
from tests.trainer.test_batching import traj as train_traj


def sampled(t: data_pb2.Trajectory, temperature: float) -> data_pb2.Trajectory:
    t.sampling.CopyFrom(data_pb2.SamplingParams(temperature=temperature, top_p=1.0))
    return t


def test_a_trajectory_at_the_runs_temperature_or_without_sampling_is_honoured():
    assert temperature_mismatch(sampled(traj("g", 0), 0.7), 0.7) == ""
    assert temperature_mismatch(traj("g", 0), 0.7) == ""                   # says nothing: the run's
    why = temperature_mismatch(sampled(traj("g", 0), 1.0), 0.7)
    assert why.startswith("sampling.temperature: trajectory g-0 was sampled at 1, the run trains at 0.7")
    mixed = temperature_mismatch(sampled(traj("g", 0), MIXED_TEMPERATURE), 1.0)
    assert mixed.startswith("sampling.temperature: the turns of trajectory g-0 were sampled at different")


def test_a_gateway_paths_sampling_is_its_turns_when_they_agree():
    agree = path_sampling([{"temperature": 0.7, "top_p": 0.9, "top_k": 0}, {"temperature": 0.7, "top_p": 0.9}])
    assert agree.temperature == pytest.approx(0.7) and agree.top_p == pytest.approx(0.9)
    assert path_sampling([{"temperature": 0.7}, {"temperature": 1.0}]).temperature == MIXED_TEMPERATURE


def test_the_rollout_records_the_works_sampling_on_each_trajectory():
    work = data_pb2.PromptWork(work_id="w", group_id="g", group_size=1, prompt_ids=[1], split="train",
                               sampling=data_pb2.SamplingParams(temperature=0.6, top_p=0.95, top_k=5,
                                                                max_new_tokens=4, stop_token_ids=[2]))

    class Seq:
        output_ids, logprobs, versions, finish_reason, routes = [3], [-0.5], [0], "stop", None

    (t,) = to_trajectories(work, [Seq()])
    assert (t.sampling.temperature, t.sampling.top_k, t.sampling.max_new_tokens) == (pytest.approx(0.6), 5, 4)
    assert not t.sampling.stop_token_ids   # not repeated on every trajectory


def test_the_trainer_refuses_a_batch_with_a_trajectory_at_another_temperature():
    good = [sampled(train_traj(f"a{i}", "g", [1, 2], [3], float(i % 2)), 1.0) for i in range(2)]
    assert pack(good, 0, temperature=1.0).size == 2
    bad = [*good, sampled(train_traj("b", "h", [1, 2], [3], 1.0), 0.5)]
    with pytest.raises(ValueError, match=r"^sampling\.temperature: trajectory b was sampled at 0\.5"):
        pack(bad, 0, temperature=1.0)


async def test_the_builder_dead_letters_a_trajectory_sampled_at_another_temperature(nats_server):
    from services.common.bus import Bus

    assert BuilderConfig().sampling.temperature == 1.0
    bus = await Bus.connect(nats_server.url, name="builder")
    builder, stop = await recovered(bus)
    try:
        await builder.handle_scored(sampled(traj("o-0", 0), 1.0), FakeMsg())
        with pytest.raises(InvalidMessage, match=r"^sampling\.temperature: trajectory o-0-1 was sampled at 0\.7"):
            await builder.handle_scored(sampled(traj("o-0", 1), 0.7), FakeMsg())
        assert builder.received == 0 and builder.batches_published == 0
    finally:
        await shut(builder, stop, bus)
