"""The sampling temperature a trajectory carries, and whether a trainer at the run's temperature can honour it.

The trainer recomputes each completion token's log-prob at one temperature (the run's `sampling.temperature`); the
importance ratios against the behaviour log-probs are only right when the tokens were sampled at that temperature.
The builder dead-letters a trajectory that was not (an agent that chose its own); the trainer skips a batch that
holds one anyway.
"""

from __future__ import annotations

import math

from services.common.contracts import data_pb2

MIXED_TEMPERATURE = -1.0  # Trajectory.sampling.temperature of a gateway path whose turns used different ones
TOLERANCE = 1e-6          # float32 on the wire


def temperature_mismatch(traj: data_pb2.Trajectory, temperature: float) -> str:
    """"" when `traj` was sampled at `temperature` (or says nothing about it), else why not, naming the field."""
    if not traj.HasField("sampling"):
        return ""
    got = traj.sampling.temperature
    if got == MIXED_TEMPERATURE:
        return (f"sampling.temperature: the turns of trajectory {traj.trajectory_id} were sampled at different "
                f"temperatures; the run trains at {temperature:g} (an agent's every request must use it, or leave "
                "it unset)")
    if not math.isclose(got, temperature, rel_tol=0, abs_tol=TOLERANCE):
        return (f"sampling.temperature: trajectory {traj.trajectory_id} was sampled at {got:g}, the run trains at "
                f"{temperature:g} (services.builder.sampling.temperature): its log-prob ratios would be wrong")
    return ""


def path_sampling(turns: list[dict]) -> data_pb2.SamplingParams:
    """The sampling of a path of gateway turns (each {"temperature", "top_p", "top_k"}): theirs when they agree,
    else MIXED_TEMPERATURE."""
    temperatures = {float(t.get("temperature", 1.0)) for t in turns}
    last = turns[-1]
    return data_pb2.SamplingParams(
        temperature=temperatures.pop() if len(temperatures) == 1 else MIXED_TEMPERATURE,
        top_p=float(last.get("top_p", 1.0)), top_k=int(last.get("top_k", 0) or 0))
