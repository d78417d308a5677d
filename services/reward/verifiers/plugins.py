"""Third-party verifiers, discovered through the `meshrl.verifiers` entry-point group.

A plugin package declares, in its pyproject.toml:

    [project.entry-points."meshrl.verifiers"]
    my_verifier = "my_package.module:MyVerifier"

The object named is a class (instantiated with no arguments), an instance, or a plain function
`score(response, task)`. Its `score(response: str, task: dict) -> float | (reward, detail) | Verdict` grades a
response against the trajectory's metadata (a Verdict may carry `steps`, process rewards: each a StepVerdict with
the character offset where its step ends in the response; the reward service places each on the completion token
that ends it); an optional `check(task)` raises ValueError naming the field for a task
it can never score, and an optional `reward_range` attribute, a (low, high) pair (default (0, 1)): a reward outside
it is clamped into it. Plugins need no import of meshrl. They run in the reward service's worker processes with a
deadline, like math-verify; built-in names win over a plugin of the same name.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.verifiers.base import REWARD_RANGE, StepVerdict, Verdict, check_range

GROUP = "meshrl.verifiers"


def discover() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed plugins by name (read from the installed distributions' metadata each call)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


class PluginVerifier:
    isolated = True

    def __init__(self, name: str, impl: Any) -> None:
        self.name = name
        self._impl = impl
        self._score = getattr(impl, "score", impl)
        self.reward_range = check_range(getattr(impl, "reward_range", REWARD_RANGE), f"plugin {name!r}: reward_range")

    def check(self, task: Mapping[str, Any]) -> None:
        check = getattr(self._impl, "check", None)
        if check is None:
            return
        try:
            check(task)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin that cannot read this task refuses it, naming itself
            raise FieldError("grading", f"refused by plugin {self.name!r} ({type(exc).__name__}: {exc})") from exc

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        result = self._score(response, task)
        steps: tuple[StepVerdict, ...] = ()
        if isinstance(result, Verdict):
            reward, detail, steps = result.reward, result.detail, result.steps
        elif isinstance(result, tuple) and len(result) == 2:
            reward, detail = result
        else:
            reward, detail = result, ""
        reward = float(reward)
        if not math.isfinite(reward):
            raise RuntimeError(f"plugin {self.name!r} returned a non-finite reward {reward!r}")
        for step in steps:
            if not (isinstance(step, StepVerdict) and math.isfinite(step.reward)):
                raise RuntimeError(f"plugin {self.name!r} returned a bad step {step!r} (StepVerdict, finite reward)")
        return Verdict(reward, str(detail), tuple(steps))


def load(name: str, ep: importlib.metadata.EntryPoint, field: str) -> PluginVerifier:
    try:
        obj = ep.load()
        impl = obj() if isinstance(obj, type) else obj
    except Exception as exc:  # noqa: BLE001 - whatever a broken plugin raises, name it and the field
        raise FieldError(field, f"plugin {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(impl, "score", impl)):
        raise FieldError(field, f"plugin {name!r} ({ep.value}) has no score(response, task)")
    try:
        return PluginVerifier(name, impl)
    except ValueError as exc:
        raise FieldError(field, f"{exc}") from None
