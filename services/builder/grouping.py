"""Grouping trajectories by prompt and assembling training batches with the staleness filter. No I/O."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.staleness import oldest_version, staleness


@dataclasses.dataclass
class Group:
    group_id: str
    size: int
    members: dict[str, data_pb2.Trajectory] = dataclasses.field(default_factory=dict)
    acks: list[Any] = dataclasses.field(default_factory=list)  # opaque handles acked when the group is consumed

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.size

    def versions(self) -> Iterator[int]:
        return (v for t in self.members.values() for v in t.versions)

    def oldest_version(self) -> int | None:
        return oldest_version(self.versions())

    def staleness(self, train_version: int) -> int:
        return staleness(self.versions(), train_version)


def reward_varies(group: Group) -> bool:
    """DAPO's dynamic-sampling test: at least two distinct rewards. A group of equal rewards (or of one sample)
    has zero group-relative advantage everywhere and would train nothing."""
    return len({t.reward for t in group.members.values()}) > 1


def check_group_size(traj: data_pb2.Trajectory) -> None:
    if traj.group_size < 1:
        raise FieldError("group_size", f"must be >= 1, got {traj.group_size}")


def check_rewards(traj: data_pb2.Trajectory, max_abs: float) -> None:
    """ValueError naming the field unless the reward and every step reward are finite and within +-`max_abs`
    (`max_abs_reward`): one inf or NaN voids its group's advantages and so most of a training step; a huge finite
    one swamps every other group's (agents set rewards, so nothing upstream bounds them for sure)."""
    rewards = [("reward", traj.reward), *((f"step_rewards[{k}].reward", s.reward)
                                          for k, s in enumerate(traj.step_rewards))]
    for field, reward in rewards:
        if not math.isfinite(reward) or abs(reward) > max_abs:
            raise FieldError(field, f"{reward!r} is not a finite number within [-{max_abs:g}, {max_abs:g}] "
                             "(max_abs_reward)")


class GroupAssembler:
    """Collects trajectories until each group has `group_size` distinct members.

    A group stays known (open, or ready for a batch) until `forget`: a redelivered member of a ready group
    only adds its ack handle, it never opens the group a second time.
    """

    def __init__(self) -> None:
        self.open: dict[str, Group] = {}
        self.ready: collections.deque[Group] = collections.deque()
        self.known: dict[str, Group] = {}
        self.duplicates = 0

    def add(self, traj: data_pb2.Trajectory, ack: Any = None) -> Group | None:
        """Returns the group when this trajectory completed it. A trajectory seen before is ignored."""
        check_group_size(traj)
        group = self.known.get(traj.group_id)
        if group is None:
            group = self.open[traj.group_id] = self.known[traj.group_id] = Group(traj.group_id, traj.group_size)
        if ack is not None and not any(a is ack for a in group.acks):  # a group message holds several members
            group.acks.append(ack)
        if traj.trajectory_id in group.members or group.complete:
            self.duplicates += 1
            return None
        group.members[traj.trajectory_id] = traj
        if group.complete:
            del self.open[traj.group_id]
            self.ready.append(group)
            return group
        return None

    def forget(self, group_id: str) -> Group | None:
        """The group was batched or dropped: later deliveries of its members are the caller's to settle."""
        group = self.known.pop(group_id, None)
        self.open.pop(group_id, None)
        if group is not None and group in self.ready:
            self.ready.remove(group)
        return group

    def held(self) -> list[Any]:
        """Every ack handle still held (kept alive while their groups wait)."""
        return [a for g in self.known.values() for a in g.acks]


@dataclasses.dataclass
class BatchResult:
    batch: data_pb2.TrainingBatch | None
    groups: list[Group]           # groups in the batch
    stale: list[Group]            # groups dropped for staleness


def assemble_batch(ready: collections.deque[Group], *, batch_size: int, index: int, max_staleness: int,
                   batch_id: str, created_at: float) -> BatchResult:
    """Take complete groups until `batch_size` fresh ones are found; batch `index` trains at version `index`.

    Stale groups (oldest token older than index - eta) are removed from `ready` and returned. When fewer
    than batch_size fresh groups remain, the fresh ones go back and no batch is made.
    """
    fresh: list[Group] = []
    stale: list[Group] = []
    while ready and len(fresh) < batch_size:
        group = ready.popleft()
        (stale if group.staleness(index) > max_staleness else fresh).append(group)
    if len(fresh) < batch_size:
        ready.extendleft(reversed(fresh))
        return BatchResult(None, [], stale)
    batch = data_pb2.TrainingBatch(
        batch_id=batch_id, index=index, created_at=created_at, dropped_stale=sum(len(g.members) for g in stale),
        trajectories=[t for g in fresh for t in sorted(g.members.values(), key=lambda t: t.trajectory_id)])
    return BatchResult(batch, fresh, stale)
