"""Numeric / symbolic answers checked with math-verify."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import (
    NoOptions,
    Verdict,
    check_task,
    extract,
    extract_mode,
    parse_options,
    reference_answer,
)

_INTEGER = re.compile(r"-?\d{1,64}")


class MathVerifier:
    """Symbolic checks can run for unbounded time on adversarial input: the reward service runs this verifier in
    worker processes with a deadline (`isolated`; see pool.py)."""

    name = "math"
    isolated = True

    def check(self, task: Mapping[str, Any]) -> None:
        check_task(task)
        parse_options(NoOptions, task.get("verifier_options"), "grading.verifier_options")

    def quick(self, response: str, task: Mapping[str, Any]) -> Verdict | None:
        """The verdict when it needs no symbolic check (no answer; gold and answer both plain integers, which
        math-verify compares by value: "007" is 7, "-0" is 0), in bounded time in the caller's process; else None."""
        gold = reference_answer(task)
        answer = extract(response, extract_mode(task))
        if answer is None:
            return Verdict(0.0, "no answer found")
        gold, answer = gold.strip(), answer.strip()
        if _INTEGER.fullmatch(gold) and _INTEGER.fullmatch(answer):
            return Verdict(1.0 if int(gold) == int(answer) else 0.0, f"answer {answer!r} vs {gold!r}")
        return None

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        if (verdict := self.quick(response, task)) is not None:
            return verdict
        import math_verify  # here: sympy's import (~0.5 s) is paid by the worker that verifies, not every importer

        gold = reference_answer(task)
        answer = extract(response, extract_mode(task))
        ok = math_verify.verify(math_verify.parse(gold), math_verify.parse(answer), timeout_seconds=None)
        return Verdict(1.0 if ok else 0.0, f"answer {answer!r} vs {gold!r}")
