"""The verifier interface, answer extraction and option parsing shared by verifiers."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from services.common.errors import FieldError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    """One step of a response: it ends before character `end` of the response, and earns `reward`."""
    end: int
    reward: float


@dataclasses.dataclass(frozen=True)
class Verdict:
    reward: float
    detail: str
    # process rewards, in order: each step's reward and where it ends in the response (the reward service places
    # each on the completion token that ends it: Trajectory.step_rewards). Empty: an outcome reward only.
    steps: tuple[StepVerdict, ...] = ()


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """For verifiers that take no `verifier_options`."""


REWARD_RANGE = (0.0, 1.0)


class Verifier(Protocol):
    """`check` raises ValueError naming the field for a task this verifier can never score (run before any work);
    `isolated` verifiers may be slow and run in worker processes with a deadline (pool.py); one may also define
    `quick(response, task) -> Verdict | None`, a bounded-time check the scorer runs in its own process first (None:
    the worker decides), and `reward_range`, the (low, high) its rewards lie in (default REWARD_RANGE): the
    scorer clamps every verdict to it (`clamp`), before the shaping terms."""

    name: str
    isolated: bool

    def check(self, task: Mapping[str, Any]) -> None: ...

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict: ...


def reward_range(verifier: object) -> tuple[float, float]:
    """The verifier's declared `reward_range`, else [0, 1]."""
    return getattr(verifier, "reward_range", REWARD_RANGE)


def check_range(bounds: object, field: str) -> tuple[float, float]:
    """`bounds` as a (low, high) pair of finite numbers, low < high; ValueError naming `field` otherwise."""
    try:
        low, high = (float(x) for x in bounds)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise FieldError(field, f"must be a (low, high) pair of numbers, got {bounds!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise FieldError(field, f"must be finite with low < high, got {bounds!r}")
    return low, high


def clamp(verdict: Verdict, bounds: tuple[float, float]) -> Verdict:
    """The verdict with its reward inside `bounds` (NaN: the low end); the detail says when it was clamped, since
    an out-of-range reward is a verifier bug or a forged verdict."""
    low, high = bounds

    def inside(reward: float) -> float:
        return low if math.isnan(reward) else min(max(reward, low), high)

    steps = tuple(StepVerdict(s.end, inside(s.reward)) for s in verdict.steps)
    reward = verdict.reward
    if low <= reward <= high:
        return dataclasses.replace(verdict, steps=steps)
    return Verdict(inside(reward), f"{verdict.detail} (reward {reward!r} clamped to [{low:g}, {high:g}])", steps)


def reference_answer(task: Mapping[str, Any]) -> str:
    answer = task.get("answer")
    if answer is None or str(answer) == "":
        raise FieldError("grading.answer", "missing")
    return str(answer)


EXTRACTS = ("last_number", "tag", "all")


def extract_mode(task: Mapping[str, Any]) -> str:
    how = str(task.get("extract", "all"))
    if how not in EXTRACTS:
        raise FieldError("grading.extract", f"unknown {how!r} (known: {', '.join(EXTRACTS)})")
    return how


def check_task(task: Mapping[str, Any]) -> None:
    """ValueError naming the field when no answer-matching verifier could score against `task`."""
    reference_answer(task)
    extract_mode(task)


def extract(response: str, how: str) -> str | None:
    """Pull the final answer out of a response: "last_number", "tag" (<answer>..</answer>) or "all"."""
    if how == "last_number":
        found = _NUMBER.findall(response)
        return found[-1] if found else None
    if how == "tag":
        found = _TAG.findall(response)
        return found[-1].strip() if found else None
    if how == "all":
        return response.strip()
    raise FieldError("grading.extract", f"unknown {how!r} (known: last_number, tag, all)")


def parse_options(cls: type[T], raw: Any, field: str) -> T:
    """A frozen options dataclass from a msgpack map; every field needs a default, whose type the value must have
    (an int is accepted for a float). ValueError naming `field.<key>` for unknown keys and wrong types."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise FieldError(field, f"must be a map, got {type(raw).__name__}")
    known = {f.name: f.default for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise FieldError(f"{field}.{key}", f"unknown option (known: {', '.join(known) or 'none'})")
        values[key] = _typed(value, known[key], f"{field}.{key}")
    return cls(**values)


def _typed(value: Any, default: Any, field: str) -> Any:
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif isinstance(value, type(default)) and not isinstance(value, bool):
        return value
    raise FieldError(field, f"must be {type(default).__name__}, got {value!r}")
