"""Shaping terms added to the correctness verifier's reward, from `grading.shaping` (a list of maps):

- `{"name": "format", "pattern": ..., "weight": 0.1, "fullmatch": false}`: +weight when the response matches the
  pattern (default: an `<answer>...</answer>` span anywhere).
- `{"name": "length", "max_chars": N, "weight": 0.1}` (or `"max_tokens": N`): -weight * min(1, excess / N) for a
  response longer than N, so the full penalty is reached at twice the limit.

reward = correctness + the sum of the terms, unclipped; the verdict's detail lists each term.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.verifiers.base import Verdict, parse_options
from services.reward.verifiers.regex import compile_pattern


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatTerm:
    pattern: str = r"(?s)<answer>.*?</answer>"
    weight: float = 0.1
    fullmatch: bool = False

    def validate(self, field: str) -> None:
        compile_pattern(self.pattern, f"{field}.pattern", groups=False)

    def value(self, response: str, n_tokens: int | None) -> float:
        pattern = re.compile(self.pattern)
        found = pattern.fullmatch(response) if self.fullmatch else pattern.search(response)
        return self.weight if found else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthTerm:
    max_chars: int = 0
    max_tokens: int = 0
    weight: float = 0.1

    def validate(self, field: str) -> None:
        if (self.max_chars > 0) == (self.max_tokens > 0) or min(self.max_chars, self.max_tokens) < 0:
            raise FieldError(field, "give one of max_chars, max_tokens, as a positive integer")

    def value(self, response: str, n_tokens: int | None) -> float:
        limit, size = (self.max_chars, len(response)) if self.max_chars else (self.max_tokens, n_tokens)
        if size is None:
            raise FieldError("max_tokens", "no token count for this response (use max_chars)")
        return -self.weight * min(1.0, max(0, size - limit) / limit)


TERMS = {"format": FormatTerm, "length": LengthTerm}
Term = FormatTerm | LengthTerm


def parse_shaping(raw: Any) -> list[Term]:
    """The terms of `grading.shaping`; ValueError naming the entry and key for anything malformed."""
    if raw is None:
        return []
    if not isinstance(raw, list | tuple):
        raise FieldError("grading.shaping", "must be a list of maps")
    terms = []
    for i, item in enumerate(raw):
        field = f"grading.shaping[{i}]"
        if not isinstance(item, Mapping):
            raise FieldError(field, "must be a map")
        name = item.get("name")
        if not isinstance(name, str) or name not in TERMS:
            raise FieldError(f"{field}.name", f"unknown {name!r} (known: {', '.join(TERMS)})")
        term = parse_options(TERMS[name], {k: v for k, v in item.items() if k != "name"}, field)
        term.validate(field)
        terms.append(term)
    return terms


def needs_tokens(terms: list[Term]) -> bool:
    return any(isinstance(t, LengthTerm) and t.max_tokens for t in terms)


def apply(terms: list[Term], verdict: Verdict, response: str, n_tokens: int | None) -> Verdict:
    if not terms:
        return verdict
    reward, details = verdict.reward, [verdict.detail]
    for term in terms:
        value = term.value(response, n_tokens)
        reward += value
        details.append(f"{type(term).__name__.removesuffix('Term').lower()} {value:+g}")
    return Verdict(reward, "; ".join(details), verdict.steps)   # shaping terms weigh the outcome, not the steps
