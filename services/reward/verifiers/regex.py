"""A regular expression pulls the answer out of the response (its last match; the group named "answer", else group
1); the answer matches when it equals the reference after both are normalised the same way.

`grading.extract` does not apply: the pattern is the extraction. Inline flags such as `(?i)` or `(?s)` set
matching options. Patterns come from the run's dataset configuration (the operator's, over an authenticated bus, not
the model's), so they run in-process; only the response is untrusted.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.verifiers.base import Verdict, parse_options, reference_answer
from services.reward.verifiers.normalize import Normalization

FIELD = "grading.verifier_options"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegexOptions(Normalization):
    pattern: str = ""


def compile_pattern(pattern: str, field: str, *, groups: bool) -> re.Pattern[str]:
    """ValueError naming `field` for a missing or broken pattern (or one without a capture group, if `groups`)."""
    if not pattern:
        raise FieldError(field, "missing")
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise FieldError(field, f"not a regular expression ({exc})") from exc
    if groups and compiled.groups < 1:
        raise FieldError(field, "needs a capture group for the answer")
    return compiled


class RegexVerifier:
    name = "regex"
    isolated = False

    def _options(self, task: Mapping[str, Any]) -> tuple[RegexOptions, re.Pattern[str]]:
        options = parse_options(RegexOptions, task.get("verifier_options"), FIELD)
        return options, compile_pattern(options.pattern, f"{FIELD}.pattern", groups=True)

    def check(self, task: Mapping[str, Any]) -> None:
        reference_answer(task)
        self._options(task)

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        options, pattern = self._options(task)
        gold = options.apply(reference_answer(task))
        last = None
        for last in pattern.finditer(response):  # noqa: B007 - the last match is the final answer
            pass
        if last is None:
            return Verdict(0.0, "pattern not found")
        answer = last.group("answer") if "answer" in pattern.groupindex else last.group(1)
        ok = answer is not None and options.apply(answer) == gold
        return Verdict(1.0 if ok else 0.0, f"answer {answer!r} vs {gold!r}")
