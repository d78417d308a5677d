"""Process rewards on a trajectory (`Trajectory.step_rewards`): the check every edge runs before accepting one."""

from __future__ import annotations

import math

from services.common.contracts import data_pb2
from services.common.errors import FieldError


def check_step_rewards(traj: data_pb2.Trajectory) -> None:
    """ValueError naming `step_rewards` unless every step ends on a trained completion token, the ends strictly
    increase and every reward is finite (a step reward sits on the token that ends its step)."""
    n, previous = len(traj.completion_ids), 0
    for k, step in enumerate(traj.step_rewards):
        if not previous < step.end <= n:
            raise FieldError(f"step_rewards[{k}].end", f"{step.end} is not in ({previous}, {n}] (ends strictly "
                             f"increase and stay within the {n} completion tokens)")
        if traj.loss_mask and not traj.loss_mask[step.end - 1]:
            raise FieldError(f"step_rewards[{k}].end", f"completion token {step.end - 1} is not trained (loss_mask 0)")
        if not math.isfinite(step.reward):
            raise FieldError(f"step_rewards[{k}].reward", "must be finite")
        previous = step.end
