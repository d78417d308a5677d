"""Verifiers by name: each scores a response text against the task's metadata (see registry.py)."""

from __future__ import annotations

from services.reward.verifiers.base import Verdict, Verifier
from services.reward.verifiers.registry import BUILTIN, build_verifier, verifier_names

__all__ = ["BUILTIN", "Verdict", "Verifier", "build_verifier", "verifier_names"]
