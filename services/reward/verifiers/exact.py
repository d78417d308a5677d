"""Exact string match after normalisation (by default: surrounding whitespace stripped)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import Verdict, check_task, extract, extract_mode, parse_options, reference_answer
from services.reward.verifiers.normalize import Normalization


class ExactMatchVerifier:
    name = "exact"
    isolated = False

    def check(self, task: Mapping[str, Any]) -> None:
        check_task(task)
        parse_options(Normalization, task.get("verifier_options"), "grading.verifier_options")

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        norm = parse_options(Normalization, task.get("verifier_options"), "grading.verifier_options")
        gold = norm.apply(reference_answer(task))
        answer = extract(response, extract_mode(task))
        ok = answer is not None and norm.apply(answer) == gold
        return Verdict(1.0 if ok else 0.0, f"answer {answer!r} vs {gold!r}")
