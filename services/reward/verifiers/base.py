"""The verifier interface and answer extraction shared by verifiers."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Protocol

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


@dataclasses.dataclass(frozen=True)
class Verdict:
    reward: float
    detail: str


class Verifier(Protocol):
    name: str

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict: ...


def reference_answer(task: Mapping[str, Any]) -> str:
    answer = task.get("answer")
    if answer is None or str(answer) == "":
        raise ValueError("metadata.answer: missing")
    return str(answer)


EXTRACTS = ("last_number", "tag", "all")


def check_task(task: Mapping[str, Any]) -> None:
    """ValueError naming the field when no verifier could score against `task` (checked before any work)."""
    reference_answer(task)
    how = str(task.get("extract", "all"))
    if how not in EXTRACTS:
        raise ValueError(f"metadata.extract: unknown {how!r} (known: {', '.join(EXTRACTS)})")


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
    raise ValueError(f"metadata.extract: unknown {how!r} (known: last_number, tag, all)")
