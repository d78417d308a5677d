"""Verifier names to verifiers: the built-ins, `reasoning_gym:<family>` for every reasoning-gym family, and the
plugins installed under the `meshrl.verifiers` entry-point group.

Verifiers are built with no arguments. The few that need service configuration read it from their module, set once
at start-up: code verifiers from `sandbox.configure(...)`, `llm_judge` from `judge.configure(...)` (both called by
services/reward/server.py; a judge that was never configured refuses its tasks in `check`)."""

from __future__ import annotations

from collections.abc import Callable

from services.common.errors import FieldError
from services.reward.verifiers import plugins, rgym
from services.reward.verifiers.arithmetic_chain import ArithmeticChainVerifier
from services.reward.verifiers.base import Verifier
from services.reward.verifiers.code_io import CodeIOVerifier
from services.reward.verifiers.code_tests import CodeTestsVerifier
from services.reward.verifiers.exact import ExactMatchVerifier
from services.reward.verifiers.judge import JudgeVerifier
from services.reward.verifiers.math import MathVerifier
from services.reward.verifiers.regex import RegexVerifier

BUILTIN: dict[str, Callable[[], Verifier]] = {"math": MathVerifier, "exact": ExactMatchVerifier, "regex": RegexVerifier,
                                              "code_tests": CodeTestsVerifier, "code_io": CodeIOVerifier,
                                              "llm_judge": JudgeVerifier, "arithmetic_chain": ArithmeticChainVerifier}


def build_verifier(name: str, field: str = "verifier") -> Verifier:
    """ValueError naming `field` for a name nothing answers to (or a plugin that does not load)."""
    if name in BUILTIN:
        return BUILTIN[name]()
    if name.startswith(rgym.PREFIX):
        family = name.removeprefix(rgym.PREFIX)
        if family not in rgym.families():
            raise FieldError(field, f"unknown reasoning-gym family {family!r} (ListVerifiers lists them)")
        return rgym.ReasoningGymVerifier(family)
    found = plugins.discover()
    if name in found:
        return plugins.load(name, found[name], field)
    known = [*BUILTIN, f"{rgym.PREFIX}<family>", *sorted(found)]
    raise FieldError(field, f"unknown {name!r} (known: {', '.join(known)})")


def verifier_names() -> list[str]:
    """Every name `build_verifier` answers to, reasoning-gym families spelled out one by one."""
    return sorted({*BUILTIN, *(rgym.PREFIX + family for family in rgym.families()), *plugins.discover()})
