"""Turning dataset tasks into prompt work. No I/O."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator

import msgpack

from services.builder.datasets import Task, generate_split
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
    tasks = generate_split("train", num, seed)
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def make_work(task: Task, *, work_id: str, group_id: str, group_size: int, encode: Callable[[str], list[int]],
              sampling: data_pb2.SamplingParams, version: int, split: str, issued_at: float,
              extra: dict | None = None) -> data_pb2.PromptWork:
    metadata = {"answer": task.answer, "verifier": "math", "extract": "last_number", **(extra or {})}
    return data_pb2.PromptWork(
        work_id=work_id, task_id=task.task_id, group_id=group_id, prompt_ids=encode(task.prompt),
        group_size=group_size, sampling=sampling, issued_version=version, issued_at=issued_at,
        metadata=msgpack.packb(metadata), split=split)
