"""`reasoning_gym:<family>`: the family's own scorer from the `reasoning-gym` package.

The builder sends the generated entry in `grading.rg_entry` ({question, answer, metadata}); the scorer reads it
(many families check the answer against the entry's metadata, e.g. countdown's numbers and target). The response's
answer is taken with `grading.extract` (default "all"; reasoning-gym prompts usually ask for "tag").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.verifiers.base import NoOptions, Verdict, extract, extract_mode, parse_options

PREFIX = "reasoning_gym:"


@functools.cache
def families() -> tuple[str, ...]:
    import reasoning_gym  # ~2 s of imports: only where reasoning-gym verifiers are used or listed

    return tuple(sorted(reasoning_gym.factory.DATASETS))


@functools.cache
def _score_fn(family: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(family)


def entry(task: Mapping[str, Any]) -> dict[str, Any]:
    value = task.get("rg_entry")
    if not isinstance(value, Mapping):
        raise FieldError("grading.rg_entry", "missing (the generated reasoning-gym entry: question, answer, metadata)")
    for key in ("question", "answer", "metadata"):
        if key not in value:
            raise FieldError(f"grading.rg_entry.{key}", "missing")
    if not isinstance(value["metadata"], Mapping):
        raise FieldError("grading.rg_entry.metadata", "must be a map")
    return dict(value)


class ReasoningGymVerifier:
    isolated = True  # some scorers parse or evaluate expressions: worker processes with a deadline

    def __init__(self, family: str) -> None:
        self.family = family
        self.name = PREFIX + family

    def warm(self) -> None:
        """Build the family's scorer ahead of the first verification (its worker calls this on load)."""
        _score_fn(self.family)

    def check(self, task: Mapping[str, Any]) -> None:
        entry(task)
        extract_mode(task)
        parse_options(NoOptions, task.get("verifier_options"), "grading.verifier_options")

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        answer = extract(response, extract_mode(task))
        reward = float(_score_fn(self.family)(answer, entry(task)))
        return Verdict(reward, f"{self.name}: answer {answer!r} vs {task['rg_entry']['answer']!r}")
