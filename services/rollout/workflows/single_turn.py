"""Single-turn workflow: one prompt work -> a group of trajectories with per-token versions.

Prompt work is validated whole before anything is admitted to the engine (`validate_work`): a message that can
never run is an InvalidMessage (dead-lettered with the reason), never a model step that fails other work.
"""

from __future__ import annotations

from typing import Any

from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.common.ids import HEADER_ID, now
from services.common.images import check_refs
from services.common.moe_routing import to_proto
from services.rollout.engines.base import MAX_SAMPLES
from services.rollout.engines.sequence import Sampling, Sequence

MAX_GROUP_SIZE = MAX_SAMPLES
MAX_NAME_CHARS = 1024                      # task_id
SPLITS = ("", "train", "eval")


def sampling_from_proto(params: data_pb2.SamplingParams) -> Sampling:
    try:
        return Sampling(temperature=params.temperature, top_p=params.top_p or 1.0, top_k=params.top_k,
                        max_new_tokens=params.max_new_tokens, stop_token_ids=tuple(params.stop_token_ids),
                        ignore_eos=params.ignore_eos)
    except ValueError as exc:
        raise InvalidMessage(f"sampling.{exc}") from exc


def check_id(value: str, field: str) -> None:
    if not value:
        raise InvalidMessage(f"{field}: missing")
    if not HEADER_ID.fullmatch(value):
        raise InvalidMessage(f"{field}: must be 1-256 visible ASCII characters without spaces")


def validate_work(work: data_pb2.PromptWork, engine: Any = None) -> Sampling:
    """InvalidMessage naming the field unless the work can run; with `engine`, also its token ids (in
    [0, vocab_size)), prompt length and max_new_tokens against that engine. Returns the work's Sampling."""
    check_id(work.work_id, "work_id")
    if not work.prompt_ids:
        raise InvalidMessage("prompt_ids: empty")
    if not 1 <= work.group_size <= MAX_GROUP_SIZE:
        raise InvalidMessage(f"group_size: must be in [1, {MAX_GROUP_SIZE}], got {work.group_size}")
    check_id(work.group_id, "group_id")  # in the group message's Nats-Msg-Id
    if len(work.task_id) > MAX_NAME_CHARS:
        raise InvalidMessage(f"task_id: longer than {MAX_NAME_CHARS} characters")
    if work.split not in SPLITS:
        raise InvalidMessage(f"split: expected 'train' or 'eval', got {work.split!r}")
    sampling = sampling_from_proto(work.sampling)
    check_refs(work.images)
    if engine is not None and not work.images:  # with images: checked once they are pixels (Rollout.images_of)
        try:
            engine.check(list(work.prompt_ids), sampling, work.group_size)
        except ValueError as exc:
            raise InvalidMessage(str(exc)) from exc
    return sampling


def to_trajectories(work: data_pb2.PromptWork, seqs: list[Sequence]) -> list[data_pb2.Trajectory]:
    """One trajectory per sample; ids derive from the work id so a redelivered work republishes the same ids."""
    finished = now()
    sampled = data_pb2.SamplingParams(temperature=work.sampling.temperature, top_p=work.sampling.top_p,
                                      top_k=work.sampling.top_k, max_new_tokens=work.sampling.max_new_tokens)
    return [
        data_pb2.Trajectory(
            trajectory_id=f"{work.work_id}-{i}", group_id=work.group_id, task_id=work.task_id, work_id=work.work_id,
            group_size=work.group_size, prompt_ids=work.prompt_ids, completion_ids=seq.output_ids,
            behavior_logprobs=seq.logprobs, versions=seq.versions, loss_mask=[1] * len(seq.output_ids),
            finish_reason=seq.finish_reason, created_at=work.issued_at, generated_at=finished,
            source="workflow", grading=work.grading, split=work.split, sampling=sampled,
            routed_experts=to_proto(seq.routes, len(work.prompt_ids) + len(seq.output_ids)), images=work.images,
        )
        for i, seq in enumerate(seqs)
    ]
