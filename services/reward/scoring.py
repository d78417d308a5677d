"""Scoring a trajectory: validate, decode, pick the verifier, check the task, verify, add shaping terms. No I/O.

The task is the trajectory's `grading` (a `Grading` message, read as the map verifiers take: `answer`, `verifier` (a
name from the registry; else the trajectory's `verifier` field, else the service default), optional
`verifier_options`, `extract`, `shaping` and, for reasoning-gym verifiers, `rg_entry`; `response: final_turn` grades
only the last run of sampled tokens, `add_reward` adds the trajectory's own reward). Everything in it is checked
before any verifier runs; a ValueError (an InvalidMessage for trajectories, which dead-letters them) names the field.

Verifiers marked `isolated` (math-verify, reasoning-gym scorers, plugins) run in worker processes with a deadline
(`timeout_s`): a verification that passes it scores 0 with the reason "timeout". `score` blocks the calling thread
at most that long; `score_async` keeps the event loop free (the consumer should await it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from services.common import grading, routed_experts
from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.ids import HEADER_ID, now
from services.common.steps import check_step_rewards
from services.reward.verifiers import Verdict, Verifier, build_verifier, shaping
from services.reward.verifiers.base import clamp, reward_range
from services.reward.verifiers.pool import VerifierPool, shared_pool

DEFAULT_TIMEOUT_S = 10.0
T = TypeVar("T")


def task_of(g: data_pb2.Grading) -> Mapping[str, Any]:
    """The map verifiers read; InvalidMessage naming the part that is not a msgpack map."""
    try:
        return grading.to_task(g)
    except ValueError as exc:
        raise InvalidMessage(str(exc)) from exc


def validate_trajectory(traj: data_pb2.Trajectory, vocab_size: int | None = None) -> None:
    if not traj.trajectory_id:
        raise InvalidMessage("trajectory_id: missing")
    if not HEADER_ID.fullmatch(traj.trajectory_id):
        raise InvalidMessage("trajectory_id: must be 1-256 visible ASCII characters without spaces")
    n = len(traj.completion_ids)
    for field in ("behavior_logprobs", "versions", "loss_mask"):
        if len(getattr(traj, field)) != n:
            raise InvalidMessage(f"{field}: {len(getattr(traj, field))} entries for {n} completion tokens")
    for field in ("prompt_ids", "completion_ids"):
        ids = getattr(traj, field)
        if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise InvalidMessage(f"{field}: token ids must be in {bound}")
    try:
        routed_experts.check(traj)
    except ValueError as exc:
        raise InvalidMessage(str(exc)) from None
    if not all(math.isfinite(x) for x in traj.behavior_logprobs):
        raise InvalidMessage("behavior_logprobs: must be finite")
    if traj.loss_mask and not set(traj.loss_mask) <= {0, 1}:
        raise InvalidMessage("loss_mask: entries must be 0 or 1")
    if traj.versions and min(traj.versions) < -1:
        raise InvalidMessage("versions: must be >= -1")
    try:
        check_step_rewards(traj)
    except ValueError as exc:
        raise InvalidMessage(str(exc)) from exc


class Scorer:
    def __init__(self, decode: Callable[[list[int]], str], default_verifier: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 vocab_size: int | None = None, pool: VerifierPool | None = None,
                 count_tokens: Callable[[str], int] | None = None) -> None:
        self.decode = decode
        self.default = default_verifier
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self.count_tokens = count_tokens  # for length shaping in max_tokens on a bare text (Score)
        self._pool = pool
        self._verifiers: dict[str, Verifier] = {}

    def verifier(self, name: str, field: str = "verifier") -> Verifier:
        if name not in self._verifiers:
            self._verifiers[name] = build_verifier(name, field)
        return self._verifiers[name]

    @property
    def pool(self) -> VerifierPool:
        if self._pool is None:
            self._pool = shared_pool()
        return self._pool

    def score_text(self, verifier: str, response: str, task: Mapping[str, Any], *, n_tokens: int | None = None,
                   field: str = "verifier") -> Verdict:
        """ValueError naming the field for a task no verifier can score; a verification past the deadline is 0.
        `field` names where the verifier's name came from, for the error."""
        return self._verify(self._check(verifier, response, task, n_tokens=n_tokens, field=field))

    def _check(self, verifier: str, response: str, task: Mapping[str, Any], *, n_tokens: int | None,
               field: str, ids: list[int] | None = None, first_token: int = 0) -> _Checked:
        """Everything before the verification itself, and its bounded-time answer when there is one."""
        name = verifier or self.default
        v = self.verifier(name, field)
        v.check(task)
        terms = shaping.parse_shaping(task.get("shaping"))
        if shaping.needs_tokens(terms) and n_tokens is None:
            if self.count_tokens is None:
                raise FieldError("grading.shaping", "max_tokens needs a token count here (use max_chars)")
            n_tokens = self.count_tokens(response)
        return _Checked(name, v, response, task, terms, n_tokens, self._quick(v, response, task), ids or [],
                        first_token)

    def _verify(self, c: _Checked) -> Verdict:
        verdict = c.quick
        if verdict is None:
            verdict = (self.pool.score(c.name, c.response, c.task, self.timeout_s) if c.verifier.isolated
                       else c.verifier.score(c.response, c.task))
        # the one place every verdict passes: within the verifier's declared range, whatever it returned
        return shaping.apply(c.terms, clamp(verdict, reward_range(c.verifier)), c.response, c.n_tokens)

    @staticmethod
    def _quick(v: Verifier, response: str, task: Mapping[str, Any]) -> Verdict | None:
        """An isolated verifier's bounded-time answer (`quick`), if it has one for this input: no worker round trip."""
        quick = getattr(v, "quick", None) if v.isolated else None
        return quick(response, task) if quick is not None else None

    async def score_text_async(self, verifier: str, response: str, task: Mapping[str, Any]) -> Verdict:
        return await asyncio.to_thread(self.score_text, verifier, response, task)

    def score(self, traj: data_pb2.Trajectory) -> data_pb2.Trajectory:
        checked = self._check_trajectory(traj)
        return self._scored(traj, checked, _as_invalid(self._verify, checked))

    async def score_async(self, traj: data_pb2.Trajectory) -> data_pb2.Trajectory:
        """`score` without blocking the event loop (a group of one)."""
        return (await self.score_group_async([traj]))[0]

    async def score_group_async(self, members: Sequence[data_pb2.Trajectory]) -> list[data_pb2.Trajectory]:
        """A group message's trajectories scored. Every member is checked before any verifier runs: one that can
        never be scored makes the whole message an InvalidMessage naming it (its group can no longer complete).
        Then they are verified together: settled on the loop when a bounded-time check answers (no thread hop),
        else on worker threads at once (each up to its deadline)."""
        checked = [_named(traj, self._check_trajectory, traj) for traj in members]
        scored: list[data_pb2.Trajectory | None] = [None] * len(members)
        slow = []
        for k, (traj, c) in enumerate(zip(members, checked, strict=True)):
            verdict = _named(traj, self._verify, c) if c.quick is not None else None
            if verdict is not None and not verdict.steps:   # the common case: settled here, no task, no thread
                scored[k] = _named(traj, self._scored, traj, c, verdict)
            else:
                slow.append((k, traj, c, verdict))

        async def verify(traj: data_pb2.Trajectory, c: _Checked, verdict: Verdict | None) -> data_pb2.Trajectory:
            if verdict is None:
                verdict = await asyncio.to_thread(_named, traj, self._verify, c)
            if verdict.steps:   # placing steps decodes prefixes of the response: off the event loop
                return await asyncio.to_thread(_named, traj, self._scored, traj, c, verdict)
            return _named(traj, self._scored, traj, c, verdict)

        for (k, *_), done in zip(slow, await asyncio.gather(*(verify(t, c, v) for _, t, c, v in slow)), strict=True):
            scored[k] = done
        return scored  # type: ignore[return-value]  # every slot filled above

    def _scored(self, traj: data_pb2.Trajectory, checked: _Checked, verdict: Verdict) -> data_pb2.Trajectory:
        """`add_reward`: the trajectory's own reward (an agent's, from the gateway) on top of the verifier's. The
        verdict's steps become its step rewards unless it came with its own (an agent's per-turn rewards stand)."""
        scored = data_pb2.Trajectory()
        scored.CopyFrom(traj)
        reward = verdict.reward + (traj.reward if checked.task.get("add_reward") else 0.0)
        scored.reward, scored.scored, scored.scored_at, scored.verifier = reward, True, now(), checked.name
        if verdict.steps and not traj.step_rewards:
            try:
                scored.step_rewards.extend(self.step_rewards(traj, checked, verdict))
            except Exception as exc:  # noqa: BLE001 - a prefix the tokenizer cannot decode: this one cannot be placed
                raise InvalidMessage(f"completion_ids: the verifier's steps cannot be placed ({type(exc).__name__}: "
                                     f"{exc})") from exc
        return scored

    def _check_trajectory(self, traj: data_pb2.Trajectory) -> _Checked:
        validate_trajectory(traj, self.vocab_size)
        task = task_of(traj.grading)
        name, field = task.get("verifier"), "grading.verifier"
        if not name:
            name, field = traj.verifier or self.default, "verifier"
        if not isinstance(name, str):
            raise InvalidMessage(f"{field}: must be a string, got {name!r}")
        start, stop = final_turn_span(traj) if task.get("response") == "final_turn" else (0, len(traj.completion_ids))
        ids = list(traj.completion_ids[start:stop])
        try:
            text = self.decode(ids)
        except Exception as exc:  # noqa: BLE001 - whatever the tokenizer refuses, this message can never be scored
            raise InvalidMessage(f"completion_ids: cannot be decoded ({type(exc).__name__}: {exc})") from exc
        return _as_invalid(self._check, name, text, task, n_tokens=len(ids), field=field, ids=ids, first_token=start)

    def step_rewards(self, traj: data_pb2.Trajectory, checked: _Checked, verdict: Verdict) -> list[data_pb2.StepReward]:
        """The verdict's steps on the completion tokens that end them: the fewest leading tokens of the response
        whose decoded text reaches each step's end (a step that ends inside a token ends with it; steps ending on one
        token merge, the lowest reward standing), moved on to the next trained token where one is not."""
        mask = list(traj.loss_mask) or [1] * len(traj.completion_ids)
        out: list[data_pb2.StepReward] = []
        lengths: dict[int, int] = {}

        def covered(k: int) -> int:
            if k not in lengths:
                lengths[k] = len(self.decode(checked.ids[:k]))
            return lengths[k]

        low = 1
        for step in sorted(verdict.steps, key=lambda step: step.end):   # (a plugin's may come in any order)
            high = len(checked.ids)
            while low < high:        # the smallest k in [low, high] whose text reaches step.end
                mid = (low + high) // 2
                if covered(mid) >= step.end:
                    high = mid
                else:
                    low = mid + 1
            end = checked.first_token + low
            while end <= len(mask) and not mask[end - 1]:
                end += 1
            if end > len(mask):
                break
            if out and out[-1].end == end:
                out[-1].reward = min(out[-1].reward, step.reward)
            else:
                out.append(data_pb2.StepReward(end=end, reward=step.reward))
        return out


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A response whose task passed its checks, ready for its verifier; `quick` is its bounded-time verdict, if any."""
    name: str
    verifier: Verifier
    response: str
    task: Mapping[str, Any]
    terms: list[shaping.Term]
    n_tokens: int | None
    quick: Verdict | None
    ids: list[int] = dataclasses.field(default_factory=list)  # the response's tokens (a trajectory's)
    first_token: int = 0        # where they start in the completion


def _named(traj: data_pb2.Trajectory, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`; a ValueError is an InvalidMessage naming the trajectory (of a group message) it is about."""
    try:
        return fn(*args)
    except ValueError as exc:
        raise InvalidMessage(f"trajectory {traj.trajectory_id!r}: {exc}") from exc


def _as_invalid(fn: Callable[..., T], *args, **kwargs) -> T:
    """A trajectory's ValueError (its task, its verifier) is an InvalidMessage: it can never be scored."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        raise InvalidMessage(str(exc)) from exc


def final_turn(traj: data_pb2.Trajectory) -> list[int]:
    """The last run of sampled tokens (loss mask 1): a gateway session's last answer, without what came before it
    (earlier turns, tool results, the template's glue). A completion without a mask is all sampled."""
    start, end = final_turn_span(traj)
    return list(traj.completion_ids[start:end])


def final_turn_span(traj: data_pb2.Trajectory) -> tuple[int, int]:
    """[start, end) of `final_turn` in the completion."""
    mask = list(traj.loss_mask) or [1] * len(traj.completion_ids)
    end = len(mask)
    while end > 0 and mask[end - 1] == 0:
        end -= 1
    start = end
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    return start, end
