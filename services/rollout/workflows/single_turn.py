"""Single-turn workflow: one prompt work -> a group of trajectories with per-token versions."""

from __future__ import annotations

from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.common.ids import now
from services.rollout.engines.sequence import Sampling, Sequence


def sampling_from_proto(params: data_pb2.SamplingParams) -> Sampling:
    try:
        return Sampling(temperature=params.temperature, top_p=params.top_p or 1.0, top_k=params.top_k,
                        max_new_tokens=params.max_new_tokens, stop_token_ids=tuple(params.stop_token_ids))
    except ValueError as exc:
        raise InvalidMessage(f"sampling.{exc}") from exc


def validate_work(work: data_pb2.PromptWork) -> None:
    if not work.work_id:
        raise InvalidMessage("work_id: missing")
    if not work.prompt_ids:
        raise InvalidMessage("prompt_ids: empty")
    if work.group_size < 1:
        raise InvalidMessage(f"group_size: must be >= 1, got {work.group_size}")


def to_trajectories(work: data_pb2.PromptWork, seqs: list[Sequence]) -> list[data_pb2.Trajectory]:
    """One trajectory per sample; ids derive from the work id so a redelivered work republishes the same ids."""
    finished = now()
    return [
        data_pb2.Trajectory(
            trajectory_id=f"{work.work_id}-{i}", group_id=work.group_id, task_id=work.task_id, work_id=work.work_id,
            group_size=work.group_size, prompt_ids=work.prompt_ids, completion_ids=seq.output_ids,
            behavior_logprobs=seq.logprobs, versions=seq.versions, loss_mask=[1] * len(seq.output_ids),
            finish_reason=seq.finish_reason, created_at=work.issued_at, generated_at=finished,
            source="workflow", metadata=work.metadata, split=work.split,
        )
        for i, seq in enumerate(seqs)
    ]
