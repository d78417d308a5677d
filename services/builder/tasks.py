"""Turning dataset tasks into prompt work. No I/O.

PromptWork.metadata (msgpack map), what the reward service grades with:
- ``answer`` (str): the reference answer;
- ``question`` (str): the prompt as text (a chat task's last user turn), for judges and plugins;
- ``verifier`` (str): math | exact | regex | reasoning_gym:<family> | a plugin name (a row's own overrides
  the dataset's);
- ``verifier_options`` (map), ``shaping`` (list of maps with a ``name``), ``extract`` (last_number | tag |
  all): only when configured (the arithmetic default sends ``extract: last_number``);
- ``rg_entry`` (map: question, answer, metadata): reasoning-gym tasks, for the family's own scorer;
- ``row`` (map): a file row's free-form metadata, kept under its own key so it never shadows the keys above;
- the builder's own keys (``eval_round``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import msgpack

from services.builder.datasets import Task, generate_split, shuffled_epochs
from services.common.contracts import data_pb2


@dataclasses.dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8

    def to_proto(self, stop_token_ids: list[int]) -> data_pb2.SamplingParams:
        return data_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                       max_new_tokens=self.max_new_tokens, stop_token_ids=stop_token_ids)


def train_stream(num: int, seed: int) -> Iterator[Task]:
    """Cycle over the train split, reshuffled every epoch."""
    return shuffled_epochs(generate_split("train", num, seed), seed)


def grading_metadata(task: Task) -> dict:
    """What the reward service grades the task with (the metadata keys listed above)."""
    return {"answer": task.answer, "question": task.question, **task.metadata}


def make_work(task: Task, *, work_id: str, group_id: str, group_size: int, encode: Callable[[Task], list[int]],
              sampling: data_pb2.SamplingParams, version: int, split: str, issued_at: float,
              extra: dict | None = None) -> data_pb2.PromptWork:
    """``encode`` renders the task's prompt into token ids (see ``DatasetConfig.encoder``)."""
    metadata = {**grading_metadata(task), **(extra or {})}
    return data_pb2.PromptWork(
        work_id=work_id, task_id=task.task_id, group_id=group_id, prompt_ids=encode(task),
        group_size=group_size, sampling=sampling, issued_version=version, issued_at=issued_at,
        metadata=msgpack.packb(metadata), split=split)
