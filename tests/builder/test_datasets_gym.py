"""reasoning-gym families as a dataset source: offline, deterministic by seed, their entries passed on."""

from __future__ import annotations

import msgpack
import pytest

from services.builder.datasets import DatasetConfig


def build(seed: int = 0, **fields):
    return DatasetConfig.from_mapping({"family": "basic_arithmetic", **fields}).build(seed=seed, train_size=30,
                                                                                       eval_size=10)


def test_a_family_generates_deterministically_by_seed():
    first, again, other = build(), build(), build(seed=1)
    assert first == again and (len(first.train), len(first.eval)) <= (30, 10) and len(first.eval) == 10
    assert [t.prompt for t in first.train] != [t.prompt for t in other.train]
    assert {t.prompt for t in first.train}.isdisjoint({t.prompt for t in first.eval})
    assert len({t.task_id for t in first.train + first.eval}) == len(first.train) + len(first.eval)


def test_tasks_carry_the_family_verifier_and_the_entry():
    config = DatasetConfig.from_mapping({"source": "reasoning_gym", "family": "basic_arithmetic",
                                         "options": {"min_terms": 2, "max_terms": 2}})
    assert config.chat
    task = config.build(seed=0, train_size=3, eval_size=2).train[0]
    assert task.metadata["verifier"] == "reasoning_gym:basic_arithmetic"
    entry = task.metadata["rg_entry"]
    assert entry["question"] == task.prompt and entry["answer"] == task.answer
    assert msgpack.unpackb(msgpack.packb(entry), raw=False) == entry  # tuples in the metadata came out as lists
    assert task.metadata["rg_entry"]["metadata"]["num_terms"] == 2


def test_the_entry_still_scores_with_the_family_scorer():
    import reasoning_gym

    task = build().eval[0]
    scorer = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=1)
    assert scorer.score_answer(task.answer, task.metadata["rg_entry"]) == 1.0


def test_bad_family_or_option_stops_start_up():
    with pytest.raises(ValueError, match="family: unknown reasoning-gym family 'no_such_family'"):
        build(family="no_such_family")
    with pytest.raises(ValueError, match="dataset.options"):
        build(options={"no_such_option": 1})
    with pytest.raises(ValueError, match="dataset.options.seed"):
        build(options={"seed": 3})
    with pytest.raises(ValueError, match="family: required"):
        DatasetConfig.from_mapping({"source": "reasoning_gym"})
    with pytest.raises(ValueError, match="family: only for source reasoning_gym"):
        DatasetConfig.from_mapping({"source": "jsonl", "train": "t.jsonl", "eval": "e.jsonl", "family": "x"})
