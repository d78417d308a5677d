"""Turning dataset tasks into prompt work (and preference rows into scored pairs). No I/O.

``PromptWork.grading`` (the ``Grading`` message in ``proto/meshrl/v1/data.proto``) is what the reward service
grades with: the reference answer, the prompt as text, the verifier (a row's own overrides the dataset's), its
options, shaping and extraction when configured (the arithmetic default sends ``extract: last_number``), a
reasoning-gym entry for the family's own scorer, a file row's free-form metadata under ``row`` (so it never
shadows the keys above), and the builder's ``eval_round`` on evaluation work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from services.builder.datasets import Task, generate_split, shuffled_epochs
from services.common import grading
from services.common.contracts import data_pb2
from services.common.images import ref_of


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


def grading_of(task: Task, **extra) -> data_pb2.Grading:
    """What the reward service grades the task with; ValueError naming ``grading.<key>`` for a value of the
    wrong type in the task's metadata."""
    return grading.to_proto({"answer": task.answer, "question": task.question, **task.metadata, **extra})


def make_work(task: Task, *, work_id: str, group_id: str, group_size: int, encode: Callable[[Task], list[int]],
              sampling: data_pb2.SamplingParams, version: int, split: str, issued_at: float,
              eval_round: int | None = None) -> data_pb2.PromptWork:
    """``encode`` renders the task's prompt into token ids (see ``DatasetConfig.encoder``)."""
    return data_pb2.PromptWork(
        work_id=work_id, task_id=task.task_id, group_id=group_id, prompt_ids=encode(task),
        group_size=group_size, sampling=sampling, issued_version=version, issued_at=issued_at,
        grading=grading_of(task, eval_round=eval_round), split=split, images=[ref_of(b) for b in task.images])


def make_pair(task: Task, *, group_id: str, encode: Callable[[Task], list[int]],
              encode_reply: Callable[[str], list[int]], sampling: data_pb2.SamplingParams,
              issued_at: float) -> list[data_pb2.Trajectory]:
    """A preference row as the two trajectories of one group, already scored: the chosen reply (reward 1) and the
    rejected one (reward 0), each ending with the first stop token. Nothing sampled them: their tokens carry
    version -1 (never stale) and behaviour log-prob 0, and they are trained on (loss mask 1) by a pairwise preset,
    which takes the higher-reward member of a group over the lower."""
    assert task.chosen is not None and task.rejected is not None, task.task_id
    prompt, stop = encode(task), list(sampling.stop_token_ids[:1])
    out = []
    for i, (reply, reward) in enumerate(((task.chosen, 1.0), (task.rejected, 0.0))):
        ids = encode_reply(reply) + stop
        out.append(data_pb2.Trajectory(
            trajectory_id=f"{group_id}-{i}", group_id=group_id, task_id=task.task_id, work_id=group_id, group_size=2,
            prompt_ids=prompt, completion_ids=ids, behavior_logprobs=[0.0] * len(ids), versions=[-1] * len(ids),
            loss_mask=[1] * len(ids), reward=reward, scored=True, finish_reason="stop", created_at=issued_at,
            generated_at=issued_at, scored_at=issued_at, source="workflow", split="train", verifier="preference",
            sampling=sampling, grading=grading_of(task)))
    return out
