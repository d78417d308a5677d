"""Whether a run's trajectories in flight fit TRAJ's byte cap, checked before the builder starts (pure: no I/O).

TRAJ is a limits stream whose byte cap is a share of `nats_max_bytes`. Over the cap JetStream deletes its oldest
messages whether or not they were acked, so a trajectory no consumer has taken yet (or one the builder holds until
its batch is published) can vanish without a dead letter: its group then times out (`group_timeout_s`) and, with
enough of them, the run crawls. The staleness budget bounds what is in flight; this module turns that bound into
bytes and refuses a run whose volume does not fit with room to spare, naming `nats_max_bytes`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from services.builder.datasets.task import Task
from services.common.bus import STREAMS
from services.common.errors import FieldError

# A Trajectory's bytes per token, an upper bound for vocabularies under 2**21 and versions under 2**21: token id
# (varint, 3), behaviour log-prob (float, 4), version (varint, 3), loss mask (1), and the prompt's text in its
# grading (question, ~4 bytes a token), rounded up.
BYTES_PER_TOKEN = 24
FIXED_BYTES = 2048   # ids, grading, sampling, timestamps, headers
# The in-flight volume may take at most this share of the cap: the cap also holds acked history, and trajectories
# published after an unacked one push it towards the front while it waits.
HEADROOM = 0.5
LONGEST_CANDIDATES = 16  # prompts tokenized to find the longest (the longest by characters)
TRAJ_SPEC = next(spec for spec in STREAMS if spec.name == "TRAJ")


def trajectory_bytes(tokens: int) -> int:
    return FIXED_BYTES + BYTES_PER_TOKEN * tokens


def in_flight_bytes(*, batch_size: int, group_size: int, max_staleness: int, trajectory_tokens: int,
                    eval_items: int = 0, eval_tokens: int = 0) -> int:
    """Bytes TRAJ holds unacked at most: admission keeps at most (eta + 1) * batch_size train groups issued and not
    yet batched (`StalenessBudget`), plus one eval round; each trajectory is stored twice (traj.raw, traj.scored)."""
    train = (max_staleness + 1) * batch_size * group_size * trajectory_bytes(trajectory_tokens)
    evals = eval_items * trajectory_bytes(eval_tokens)
    return 2 * (train + evals)


def check_traj_capacity(*, traj_max_bytes: int, batch_size: int, group_size: int, max_staleness: int,
                        trajectory_tokens: int, eval_items: int = 0, eval_tokens: int = 0) -> int:
    """The in-flight bytes; FieldError naming nats_max_bytes when they take more than HEADROOM of TRAJ's cap
    (`traj_max_bytes` <= 0: no cap, nothing to check)."""
    need = in_flight_bytes(batch_size=batch_size, group_size=group_size, max_staleness=max_staleness,
                           trajectory_tokens=trajectory_tokens, eval_items=eval_items, eval_tokens=eval_tokens)
    if traj_max_bytes > 0 and need > HEADROOM * traj_max_bytes:
        least = int(need / HEADROOM / TRAJ_SPEC.share) + 1
        raise FieldError(
            "nats_max_bytes",
            f"the trajectories a run keeps in flight, up to {need} bytes ({(max_staleness + 1) * batch_size} groups "
            f"of {group_size} at (max_staleness + 1) x batch_size, {trajectory_tokens} tokens each, stored as "
            f"traj.raw and traj.scored), do not fit {HEADROOM:.0%} of TRAJ's byte cap {traj_max_bytes}: over its "
            f"cap TRAJ deletes the oldest trajectories, acked or not. Raise nats_max_bytes to at least {least}, or "
            "lower batch_size, group_size, max_staleness or the tokens per trajectory (max_new_tokens, "
            "dataset.max_prompt_tokens)")
    return need


def longest_prompt_tokens(tasks: Sequence[Task], encode: Callable[[Task], list[int]], max_prompt_tokens: int) -> int:
    """Tokens of the longest prompt: `max_prompt_tokens` when the dataset caps them, else the longest of the
    LONGEST_CANDIDATES prompts longest in characters (tokenizing every row would cost start-up seconds)."""
    if max_prompt_tokens > 0:
        return max_prompt_tokens
    longest = heapq.nlargest(LONGEST_CANDIDATES, tasks, key=_characters)
    return max((len(encode(task)) for task in longest), default=0)


def _characters(task: Task) -> int:
    if task.messages:
        return sum(len(str(message.get("content", ""))) for message in task.messages)
    return len(task.prompt)
