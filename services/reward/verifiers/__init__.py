"""Verifiers by name: each scores a response text against the task's metadata."""

from __future__ import annotations

from services.reward.verifiers.base import Verdict, Verifier
from services.reward.verifiers.exact import ExactMatchVerifier
from services.reward.verifiers.math import MathVerifier

VERIFIERS: dict[str, type[Verifier]] = {"math": MathVerifier, "exact": ExactMatchVerifier}


def build_verifier(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise ValueError(f"verifier: unknown {name!r} (known: {', '.join(sorted(VERIFIERS))})")
    return VERIFIERS[name]()


__all__ = ["VERIFIERS", "Verdict", "Verifier", "build_verifier"]
