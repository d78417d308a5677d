"""F4, the start-up half: a run whose trajectories in flight cannot fit TRAJ's byte cap is refused before the
builder issues anything, naming nats_max_bytes and the least budget that fits (TRAJ over its cap deletes unacked
trajectories: see test_group_timeout.py for what happens otherwise). Runs that fit start as before."""

from __future__ import annotations

import pytest

from services.builder.capacity import (
    HEADROOM,
    TRAJ_SPEC,
    check_traj_capacity,
    in_flight_bytes,
    longest_prompt_tokens,
    trajectory_bytes,
)
from services.builder.config import BuilderConfig
from services.builder.datasets.task import Task
from services.builder.server import Builder
from services.builder.tasks import SamplingConfig
from services.common.bus import MIN_MAX_BYTES, Bus
from services.common.contracts import data_pb2
from services.common.errors import FieldError


def test_in_flight_counts_the_staleness_window_twice_plus_one_eval_round():
    one = trajectory_bytes(100)
    assert in_flight_bytes(batch_size=4, group_size=8, max_staleness=1, trajectory_tokens=100) == 2 * 2 * 4 * 8 * one
    assert in_flight_bytes(batch_size=4, group_size=8, max_staleness=0, trajectory_tokens=100, eval_items=10,
                           eval_tokens=20) == 2 * (4 * 8 * one + 10 * trajectory_bytes(20))


def test_the_bound_covers_a_real_trajectory():
    """BYTES_PER_TOKEN and FIXED_BYTES bound what a trajectory of a large vocabulary and late versions serializes to."""
    prompt, completion = 300, 700
    t = data_pb2.Trajectory(trajectory_id="t" * 40, group_id="g" * 40, task_id="k" * 40, work_id="w" * 40,
                            prompt_ids=[150_000] * prompt, completion_ids=[150_000] * completion,
                            behavior_logprobs=[-0.123] * completion, versions=[1_000_000] * completion,
                            loss_mask=[1] * completion, reward=1.0, scored=True, finish_reason="length",
                            source="workflow", split="train", verifier="math",
                            grading=data_pb2.Grading(answer="42", question="word " * prompt))
    assert len(t.SerializeToString()) <= trajectory_bytes(prompt + completion)


def test_a_run_too_big_for_the_budget_is_refused_naming_nats_max_bytes_and_the_least_that_fits():
    """The review's example: 512 prompts x 16 samples x 8k tokens at the default 4 GiB budget."""
    budget = 4 << 30
    run = dict(batch_size=512, group_size=16, max_staleness=1, trajectory_tokens=8192)
    with pytest.raises(FieldError) as err:
        check_traj_capacity(traj_max_bytes=int(TRAJ_SPEC.share * budget), **run)
    assert err.value.field == "nats_max_bytes" and "acked or not" in str(err.value)
    least = int(str(err.value).split("at least ")[1].split(",")[0])
    assert least > budget
    assert check_traj_capacity(traj_max_bytes=int(TRAJ_SPEC.share * least), **run) <= HEADROOM * TRAJ_SPEC.share * least


def test_the_default_jobs_fit_the_least_budget_and_no_cap_is_never_refused():
    least_cap = int(TRAJ_SPEC.share * MIN_MAX_BYTES)
    # the tiny default job (16 x 8, eta 1, short prompts) and an agent run at a 2k context
    check_traj_capacity(traj_max_bytes=least_cap, batch_size=16, group_size=8, max_staleness=1, trajectory_tokens=80,
                        eval_items=200, eval_tokens=80)
    check_traj_capacity(traj_max_bytes=int(TRAJ_SPEC.share * (4 << 30)), batch_size=16, group_size=8,
                        max_staleness=1, trajectory_tokens=2048)
    check_traj_capacity(traj_max_bytes=-1, batch_size=10**4, group_size=64, max_staleness=8, trajectory_tokens=10**5)


def test_the_longest_prompt_is_measured_unless_the_dataset_caps_it():
    tasks = [Task(f"t{i}", "x" * i, "1") for i in range(100)]
    encoded: list[str] = []

    def encode(task: Task) -> list[int]:
        encoded.append(task.task_id)
        return [0] * (len(task.prompt) + 5)

    assert longest_prompt_tokens(tasks, encode, 0) == 99 + 5
    assert len(encoded) == 16 and "t99" in encoded  # only the longest few are tokenized
    assert longest_prompt_tokens(tasks, encode, 300) == 300
    chat = Task("c", "", "1", messages=[{"role": "user", "content": "y" * 500}])
    assert longest_prompt_tokens([*tasks, chat], lambda t: [0] * 7 if t is chat else [0], 0) == 7


async def test_a_builder_whose_run_cannot_fit_traj_refuses_to_start(nats_server):
    """At the least budget (TRAJ ~19 MiB), 64 groups of 16 with 4k new tokens each cannot be held: the builder
    stops at construction, before recovering or issuing anything. The same run with a budget that fits starts."""
    big = dict(batch_size=64, group_size=16, max_staleness=1, eval_size=4, train_size=50,
               sampling=SamplingConfig(max_new_tokens=4096))
    bus = await Bus.connect(nats_server.url, name="builder", max_bytes=MIN_MAX_BYTES)
    try:
        with pytest.raises(FieldError) as err:
            Builder(BuilderConfig(**big), bus, lambda task: [1] * 40, [0])
        assert err.value.field == "nats_max_bytes"
        least = int(str(err.value).split("at least ")[1].split(",")[0])
    finally:
        await bus.close()
    roomy = await Bus.connect(nats_server.url, name="builder", max_bytes=least, declare=False)
    try:
        builder = Builder(BuilderConfig(**big), roomy, lambda task: [1] * 40, [0])
        assert 0 < builder.traj_in_flight_bytes <= HEADROOM * TRAJ_SPEC.share * least
    finally:
        await roomy.close()
