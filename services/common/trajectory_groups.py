"""traj.raw and traj.scored carry a group's trajectories as one message (`TrajectoryGroup`): one publish, one
PubAck, one delivery, one ack per group instead of per trajectory (each hop cost 270-460 us of CPU per message).

The message id is the group id and a digest of its members' ids: a redelivered work, or a retried publish,
sends the same members under the same id and JetStream drops the copy. A group over the server's max_payload
goes as several messages, each with some of the members (each id again its members' digest); consumers merge
by group id. Consumers read a bare `Trajectory` on these subjects as a group of one: what earlier releases and
single-trajectory publishers send.

A rollout's groups that finish together go out on traj.raw as one `TrajectoryBundle` (whole groups; its id is a
digest of all their members' ids); the reward service reads it as its groups (`decode_groups`) and publishes them
scored together on traj.scored, where the builder reads it the same way.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

from nats.aio.msg import Msg

from services.common.bus import HEADER_ROOM, TYPE_HEADER, Bus, InvalidMessage
from services.common.contracts import data_pb2
from services.common.ids import HEADER_ID

GROUP_TYPE = data_pb2.TrajectoryGroup.DESCRIPTOR.full_name
TRAJECTORY_TYPE = data_pb2.Trajectory.DESCRIPTOR.full_name
BUNDLE_TYPE = data_pb2.TrajectoryBundle.DESCRIPTOR.full_name


def message_id(group: data_pb2.TrajectoryGroup) -> str:
    return f"{group.group_id}/{_digest(group.trajectories)}"


def bundle_id(bundle: data_pb2.TrajectoryBundle) -> str:
    return f"bundle/{_digest([t for g in bundle.groups for t in g.trajectories])}"


def _digest(members: Sequence[data_pb2.Trajectory]) -> str:
    return hashlib.sha1("\n".join(sorted(t.trajectory_id for t in members)).encode()).hexdigest()[:16]


def of(trajectories: Sequence[data_pb2.Trajectory]) -> data_pb2.TrajectoryGroup:
    """The group message of these members (of one group: their group id)."""
    assert trajectories, "a group message has members"
    return data_pb2.TrajectoryGroup(group_id=trajectories[0].group_id, trajectories=trajectories)


def check(group: data_pb2.TrajectoryGroup) -> None:
    """InvalidMessage naming the field unless the message is one group's distinct members of one split."""
    if not group.trajectories:
        raise InvalidMessage(f"trajectories: group {group.group_id!r} has no members")
    if not HEADER_ID.fullmatch(group.group_id):
        raise InvalidMessage("group_id: must be 1-256 visible ASCII characters without spaces (it is in the "
                             "message's Nats-Msg-Id)")
    seen: set[str] = set()
    for k, t in enumerate(group.trajectories):
        if t.group_id != group.group_id:
            raise InvalidMessage(f"trajectories[{k}].group_id: {t.group_id!r} in the message of group "
                                 f"{group.group_id!r}")
        if t.trajectory_id in seen:
            raise InvalidMessage(f"trajectories[{k}].trajectory_id: {t.trajectory_id!r} twice in one message")
        if t.split != group.trajectories[0].split:
            raise InvalidMessage(f"trajectories[{k}].split: {t.split!r} beside {group.trajectories[0].split!r}")
        seen.add(t.trajectory_id)


def decode(msg: Msg) -> data_pb2.TrajectoryGroup:
    """The consumers' decoder: a TrajectoryGroup, or a bare Trajectory as a group of one; InvalidMessage for any
    other type, undecodable bytes or a malformed group."""
    return parse((msg.headers or {}).get(TYPE_HEADER), msg.data)


def decode_groups(msg: Msg) -> list[data_pb2.TrajectoryGroup]:
    """The decoder on traj.raw and traj.scored: a bundle's groups (each checked, their ids distinct), or the one
    group of a TrajectoryGroup or bare Trajectory; InvalidMessage otherwise."""
    groups = _decode_groups((msg.headers or {}).get(TYPE_HEADER), msg.data)
    if not groups:
        raise InvalidMessage("groups: a bundle without groups")
    seen: set[str] = set()
    for k, group in enumerate(groups):
        if group.group_id in seen:
            raise InvalidMessage(f"groups[{k}].group_id: {group.group_id!r} twice in one bundle")
        seen.add(group.group_id)
        check(group)
    return groups


def parse(type_name: str | None, data: bytes) -> data_pb2.TrajectoryGroup:
    group = _decode(type_name, data)
    check(group)
    return group


def _decode_groups(type_name: str | None, data: bytes) -> list[data_pb2.TrajectoryGroup]:
    """Unchecked: a bundle's groups, or the one group of any other type `_decode` reads."""
    if type_name != BUNDLE_TYPE:
        return [_decode(type_name, data)]
    try:
        return list(data_pb2.TrajectoryBundle.FromString(data).groups)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: never decodable
        raise InvalidMessage(f"undecodable {type_name}: {exc}") from exc


def _decode(type_name: str | None, data: bytes) -> data_pb2.TrajectoryGroup:
    try:
        if type_name == GROUP_TYPE:
            return data_pb2.TrajectoryGroup.FromString(data)
        if type_name == TRAJECTORY_TYPE:
            traj = data_pb2.Trajectory.FromString(data)
            return data_pb2.TrajectoryGroup(group_id=traj.group_id, trajectories=[traj])
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends: never decodable
        raise InvalidMessage(f"undecodable {type_name}: {exc}") from exc
    raise InvalidMessage(f"wrong message type: header {TYPE_HEADER}={type_name!r}, expected {GROUP_TYPE!r} "
                         f"(or {TRAJECTORY_TYPE!r})")


def _in_order(sizes: Sequence[int], max_bytes: int, base: int = 0) -> list[list[int]]:
    """Item indices packed in order into as few runs as fit `max_bytes` (each run costs `base` more); an item over
    the limit alone is a run of its own."""
    out: list[list[int]] = [[]]
    size = base
    for k, n in enumerate(sizes):
        if out[-1] and size + n > max_bytes:
            out.append([])
            size = base
        out[-1].append(k)
        size += n
    return out


def parts(trajectories: Sequence[data_pb2.Trajectory], max_bytes: int) -> list[data_pb2.TrajectoryGroup]:
    """The group's messages: one when it fits `max_bytes`, else members packed in order into as few as fit (a
    member alone over the limit is a message of its own, which the publish refuses as too large)."""
    whole = of(trajectories)
    if whole.ByteSize() <= max_bytes:
        return [whole]
    runs = _in_order([t.ByteSize() + 8 for t in trajectories], max_bytes,  # each member's tag and length
                     base=len(whole.group_id) + 8)
    return [of([trajectories[k] for k in run]) for run in runs]


def pack(groups: Sequence[data_pb2.TrajectoryGroup], max_bytes: int) -> list[list[data_pb2.TrajectoryGroup]]:
    """Group messages packed in order into as few bundles as fit `max_bytes`; a group over it alone (it then goes
    in parts)."""
    runs = _in_order([g.ByteSize() + 8 for g in groups], max_bytes)  # each group's tag and length in the bundle
    return [[groups[k] for k in run] for run in runs]


async def publish_together(bus: Bus, subject: str, groups: Sequence[Sequence[data_pb2.Trajectory]]) -> int:
    """Publish whole groups as few bundles as fit max_payload (a group alone as its TrajectoryGroup, or in parts
    when over the limit); returns how many messages JetStream took as new."""
    sends = []
    for packed in pack([of(members) for members in groups], bus.max_payload - HEADER_ROOM):
        if len(packed) == 1:
            sends.append(publish(bus, subject, packed[0].trajectories))
        else:
            bundle = data_pb2.TrajectoryBundle(groups=packed)
            sends.append(bus.publish(subject, bundle, bundle_id(bundle)))
    return sum(await asyncio.gather(*sends))


async def publish(bus: Bus, subject: str, trajectories: Sequence[data_pb2.Trajectory]) -> int:
    """Publish one group's trajectories (as one message, or several when over max_payload); returns how many
    messages JetStream took as new (0: all duplicates of earlier publishes)."""
    messages = parts(trajectories, bus.max_payload - HEADER_ROOM)
    new = await asyncio.gather(*(bus.publish(subject, m, message_id(m)) for m in messages))
    return sum(new)


def dead_letter_items(letter: data_pb2.DeadLetter) -> list[data_pb2.Trajectory] | list[data_pb2.PromptWork]:
    """What a dead letter held: the prompt work, or the trajectories of the group message; [] when it is not
    decodable (it never belonged to a group). A letter without `type` (an earlier release's) is read by subject."""
    if letter.subject.startswith("prompts."):
        try:
            return [data_pb2.PromptWork.FromString(letter.data)]
        except Exception:  # noqa: BLE001
            return []
    try:  # unchecked: a malformed group's members still name the group that can no longer complete
        return [t for g in _decode_groups(letter.type or TRAJECTORY_TYPE, letter.data) for t in g.trajectories]
    except InvalidMessage:
        return []
