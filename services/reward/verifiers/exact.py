"""Exact string match after stripping whitespace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import Verdict, extract, reference_answer


class ExactMatchVerifier:
    name = "exact"

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        gold = reference_answer(task).strip()
        answer = extract(response, str(task.get("extract", "all")))
        ok = answer is not None and answer.strip() == gold
        return Verdict(1.0 if ok else 0.0, f"answer {answer!r} vs {gold!r}")
