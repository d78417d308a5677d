"""An ended session -> Trajectory messages (pure).

"session" mode: one trajectory per root-to-leaf path of the interaction tree (normally one per session):
the root's prompt, then every turn's sampled ids (loss mask 1, their versions and log-probs) and the
tokens between turns (tool results, user turns, template glue: mask 0, version -1). The latest leaf's
path carries the session's group id and group size; other branches travel as groups of one.
"interaction" mode: one trajectory per interaction, each its own group of one, with its discounted return.
In session mode the turns' own rewards also travel as process rewards (`step_rewards`, one per rewarded turn,
ending on the turn's last sampled token), beside the outcome `reward` (their discounted sum).
A session graded by a verifier exports unscored trajectories carrying its `grading`: the reward service scores them.
"""

from __future__ import annotations

import math
import struct

import msgpack

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.ids import now
from services.common.images import ref_of
from services.common.sampling import path_sampling
from services.rollout.gateway.session import Interaction, Session, discounted_returns


def export_session(session: Session, *, mode: str, gamma: float) -> list[data_pb2.Trajectory]:
    if not session.interactions:
        return []
    returns = dict(zip((i.id for i in session.interactions), discounted_returns(session.interactions, gamma), strict=True))
    if mode == "interaction":
        return [_interaction_traj(session, inter, returns[inter.id], n) for n, inter in enumerate(session.interactions)]
    return [_path_traj(session, path, n, primary=n == 0, gamma=gamma) for n, path in enumerate(paths(session))]


def check_rewards(trajectories: list[data_pb2.Trajectory], max_abs: float) -> None:
    """ValueError naming `reward` when an exported reward (a sum of turn rewards, as the float32 that travels) or a
    process reward is not finite or past `max_abs`: each turn's reward is in range, their sum need not be."""
    bound = struct.unpack("f", struct.pack("f", max_abs))[0]  # rounded as the rewards are (0.3 -> 0.30000001)
    for t in trajectories:
        for value, what in ((t.reward, "the discounted sum of its turns' rewards"),
                            *((s.reward, "a turn's process reward") for s in t.step_rewards)):
            if not math.isfinite(value) or abs(value) > bound:
                raise FieldError("reward", f"{t.trajectory_id} would carry {value:g} ({what}), outside "
                                 f"[-{max_abs:g}, {max_abs:g}] (max_abs_reward); set smaller turn rewards")


def oversize(trajectories: list[data_pb2.Trajectory], limit: int) -> str | None:
    """Why the export cannot be published (the first trajectory over `limit` serialised bytes), or None."""
    for t in trajectories:
        if limit and (size := t.ByteSize()) > limit:
            return (f"trajectory {t.trajectory_id} is {size} bytes serialised, over the {limit} bytes one trajectory "
                    "may take (max_trajectory_bytes)")
    return None


def paths(session: Session) -> list[list[Interaction]]:
    """Root-to-leaf paths, the path of the latest leaf first."""
    parents = {i.parent_id for i in session.interactions if i.parent_id}
    leaves = [i for i in reversed(session.interactions) if i.id not in parents]
    out = []
    for leaf in leaves:
        path, node = [], leaf
        while node is not None:
            path.append(node)
            node = session.get(node.parent_id) if node.parent_id else None
        out.append(path[::-1])
    return out


def _path_traj(session: Session, path: list[Interaction], n: int, *, primary: bool, gamma: float) -> data_pb2.Trajectory:
    root = path[0]
    ids, logprobs, versions, mask = [], [], [], []
    steps: list[data_pb2.StepReward] = []  # each turn's own reward, set with /rl/set_reward, on its last token
    for k, inter in enumerate(path):
        if k > 0:
            done = len(root.prompt_ids) + len(ids)
            glue = inter.prompt_ids[done:]
            assert inter.prompt_ids[:done] == root.prompt_ids + ids, "a child's prompt extends its parent's context"
            ids += glue
            logprobs += [0.0] * len(glue)
            versions += [-1] * len(glue)
            mask += [0] * len(glue)
        ids += inter.output_ids
        logprobs += inter.logprobs
        versions += inter.versions
        mask += [1] * len(inter.output_ids)
        if inter.reward is not None and inter.output_ids:
            steps.append(data_pb2.StepReward(end=len(ids), reward=inter.reward))
    reward = sum((gamma ** t) * (inter.reward or 0.0) for t, inter in enumerate(path))
    group_id, group_size = (session.group_id, session.group_size) if primary else (f"{session.id}-branch{n}", 1)
    traj = _trajectory(session, f"traj-{session.id}-{n}", path, root.prompt_ids, ids, logprobs, versions, mask,
                       reward, group_id, group_size, extra={"branch": not primary, "turns": len(path)})
    traj.step_rewards.extend(steps)
    return traj


def _interaction_traj(session: Session, inter: Interaction, ret: float, n: int) -> data_pb2.Trajectory:
    return _trajectory(session, f"traj-{session.id}-i{n}", [inter], inter.prompt_ids, inter.output_ids, inter.logprobs,
                       inter.versions, [1] * len(inter.output_ids), ret, f"{session.id}-i{n}", 1,
                       extra={"turn": n, "session_group_id": session.group_id, "session_group_size": session.group_size})


def _trajectory(session: Session, traj_id: str, path: list[Interaction], prompt_ids, completion_ids, logprobs, versions,
                mask, reward: float, group_id: str, group_size: int, extra: dict) -> data_pb2.Trajectory:
    meta = {"session_id": session.id, "task_id": session.task_id, "interaction_ids": [i.id for i in path],
            "apis": sorted({i.api for i in path}), "end_reason": session.end_reason, "group_index": session.group_index,
            "sampling": path[-1].sampling, "agent": session.metadata, **extra}
    graded = session.grading  # the reward service scores it (traj.raw); `reward` is the agent's, kept for add_reward
    return data_pb2.Trajectory(
        trajectory_id=traj_id, group_id=group_id, task_id=session.task_id, work_id=session.id, group_size=group_size,
        prompt_ids=prompt_ids, completion_ids=completion_ids, behavior_logprobs=logprobs, versions=versions,
        loss_mask=mask, reward=reward, scored=graded is None, finish_reason=_finish(path[-1].finish_reason),
        created_at=path[0].created_at, generated_at=path[-1].finished_at,
        scored_at=now() if graded is None else 0.0,
        source="gateway", metadata=msgpack.packb(meta, use_bin_type=True), split="train",
        verifier="agent" if graded is None else graded.verifier, grading=graded,
        sampling=path_sampling([i.sampling for i in path]),
        images=[ref_of(b) for b in path[-1].images])  # the last turn's prompt holds every earlier turn's images


def _finish(reason: str) -> str:
    return "length" if reason == "length" else "stop"
