"""Scoring a trajectory: decode, pick the verifier, set the reward. No I/O."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.common.ids import now
from services.reward.verifiers import Verdict, Verifier, build_verifier


def decode_metadata(raw: bytes) -> Mapping[str, Any]:
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False)
    except Exception as exc:
        raise InvalidMessage(f"metadata: not msgpack ({exc})") from exc
    if not isinstance(value, dict):
        raise InvalidMessage("metadata: must be a msgpack map")
    return value


def validate_trajectory(traj: data_pb2.Trajectory) -> None:
    if not traj.trajectory_id:
        raise InvalidMessage("trajectory_id: missing")
    n = len(traj.completion_ids)
    for field in ("behavior_logprobs", "versions", "loss_mask"):
        if len(getattr(traj, field)) != n:
            raise InvalidMessage(f"{field}: {len(getattr(traj, field))} entries for {n} completion tokens")


class Scorer:
    def __init__(self, decode: Callable[[list[int]], str], default_verifier: str) -> None:
        self.decode = decode
        self.default = default_verifier
        self._verifiers: dict[str, Verifier] = {}

    def verifier(self, name: str) -> Verifier:
        if name not in self._verifiers:
            self._verifiers[name] = build_verifier(name)
        return self._verifiers[name]

    def score_text(self, verifier: str, response: str, task: Mapping[str, Any]) -> Verdict:
        return self.verifier(verifier or self.default).score(response, task)

    def score(self, traj: data_pb2.Trajectory) -> data_pb2.Trajectory:
        validate_trajectory(traj)
        task = decode_metadata(traj.metadata)
        name = str(task.get("verifier") or self.default)
        try:
            verdict = self.score_text(name, self.decode(list(traj.completion_ids)), task)
        except ValueError as exc:
            raise InvalidMessage(str(exc)) from exc
        scored = data_pb2.Trajectory()
        scored.CopyFrom(traj)
        scored.reward, scored.scored, scored.scored_at, scored.verifier = verdict.reward, True, now(), name
        return scored
