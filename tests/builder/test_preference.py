"""Preference datasets (`dataset.preference`): rows of a prompt, a chosen and a rejected reply become one scored
pair each, published straight to the scored trajectories (nothing generated), and batched like any group — a real
nats-server, the builder's own issue and consume loops; a restarted builder republishes a pair it counted, and
the ids dedupe it."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.builder.config import BuilderConfig
from services.builder.datasets.config import DatasetConfig
from services.builder.server import Builder
from services.builder.tasks import make_pair
from services.common.batches import read_batch
from services.common.bus import Bus, consume, decoder
from services.common.contracts import data_pb2
from tests.builder.test_restart import FakeRollout, crash, until

ROWS = [{"prompt": f"{a} + {b} =", "chosen": f" {a + b}", "rejected": f" {a + b + 1}"} for a, b in
        [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1)]]


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def dataset(tmp_path) -> DatasetConfig:
    return DatasetConfig(train=write(tmp_path / "prefs.jsonl", ROWS), preference=True, render="raw",
                         eval=write(tmp_path / "eval.jsonl", [{"prompt": "1 + 1 =", "answer": "2"}]))


def reply_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_rows_become_pairs_and_bad_rows_are_refused_naming_the_field(dataset, tmp_path):
    data = dataset.build(seed=0, train_size=0, eval_size=0)
    assert [(t.prompt, t.chosen, t.rejected) for t in data.train] == [(r["prompt"], r["chosen"], r["rejected"])
                                                                      for r in ROWS]
    assert data.eval[0].answer == "2" and not data.eval[0].is_pair
    for bad, field in (({"prompt": "x", "chosen": "a"}, "'rejected' must be a non-empty string"),
                       ({"prompt": "x", "chosen": "a", "rejected": "a"}, "are the same reply")):
        path = write(tmp_path / "bad.jsonl", [bad])
        with pytest.raises(ValueError, match=f"bad.jsonl:1: field .*{field}|bad.jsonl:1: fields .*{field}"):
            DatasetConfig(train=path, eval=dataset.eval, preference=True).build(seed=0, train_size=0, eval_size=0)
    with pytest.raises(ValueError, match="^preference: needs a file"):
        DatasetConfig(preference=True)
    with pytest.raises(ValueError, match="^eval_fraction: a preference dataset"):
        DatasetConfig(train=dataset.train, preference=True, eval_fraction=0.1)


def test_a_pair_is_two_scored_trajectories_of_one_group(dataset):
    task = dataset.build(seed=0, train_size=0, eval_size=0).train[0]
    sampling = data_pb2.SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[0, 9])
    chosen, rejected = make_pair(task, group_id="g-7", encode=lambda t: [1, 2], encode_reply=reply_ids,
                                 sampling=sampling, issued_at=5.0)
    assert (chosen.trajectory_id, rejected.trajectory_id) == ("g-7-0", "g-7-1")
    assert chosen.group_id == rejected.group_id == "g-7" and chosen.group_size == 2
    assert list(chosen.completion_ids) == reply_ids(" 3") + [0] and list(rejected.completion_ids) == reply_ids(" 4") + [0]
    assert (chosen.reward, rejected.reward) == (1.0, 0.0) and chosen.scored and chosen.source == "workflow"
    assert set(chosen.versions) == {-1} and set(chosen.loss_mask) == {1} and list(chosen.prompt_ids) == [1, 2]


async def test_the_builder_batches_pairs_without_generating_and_republishes_after_a_crash(nats_server, dataset):
    def make(bus: Bus) -> Builder:
        config = BuilderConfig(batch_size=2, group_size=8, max_staleness=0, eval_size=1, eval_every=0,
                               train_size=0, total_steps=2, dataset=dataset)
        return Builder(config, bus, lambda task: [1, 2, 3], [0], encode_reply=reply_ids)

    stop = asyncio.Event()
    rollout_bus = await Bus.connect(nats_server.url, name="rollout")
    rollout = FakeRollout(rollout_bus)   # answers the evaluation's prompt work (the first round gates training)
    serving = asyncio.create_task(consume(rollout_bus, "rollout", decoder(data_pb2.PromptWork), rollout.handle,
                                          stop))
    bus = await Bus.connect(nats_server.url, name="builder-1")
    first = make(bus)
    tasks = [serving, *first.start(stop)]
    try:
        await until(lambda: first.batches_published == 1, "batch 0 from two pairs")
        batch = await read_batch(bus, 0)
        assert batch is not None and len(batch.trajectories) == 4 and len(batch.group_ids) == 2
        by_group: dict[str, list] = {}
        for t in batch.trajectories:
            by_group.setdefault(t.group_id, []).append(t)
        for members in by_group.values():
            assert sorted(t.reward for t in members) == [0.0, 1.0]
            chosen = next(t for t in members if t.reward == 1.0)
            assert bytes(chosen.completion_ids[:-1]).decode().strip().isdigit()
        assert rollout.works == ["eval-0-0"], "only the evaluation was sent to a rollout for generation"
        first.issued += 1                                   # a pair counted, then the process died before its
        await first.ledger.set_issued(first.issued, first.budget.refills)  # publish
        await crash(tasks[1:], bus)
        bus2 = await Bus.connect(nats_server.url, name="builder-2")
        second = make(bus2)
        tasks = [serving, *second.start(stop)]
        await until(lambda: second.live.is_set(), "recovery")
        republished = f"g-{second.issued - 1}"
        await until(lambda: republished in second.assembler.known, f"the counted pair {republished} republished")
        assert len(second.assembler.known[republished].members) == 2
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
