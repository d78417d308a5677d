"""Shared by the code verifiers: the code out of a completion, their options, the sandbox they run in."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.sandbox import Sandbox, shared_sandbox
from services.reward.sandbox.languages import language
from services.reward.verifiers.base import parse_options

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)
_PYTHON_TAGS = {"python", "py", "python3"}
MAX_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class CodeOptions:
    partial: bool = False   # reward = the fraction of tests (cases) passed, not 1 only when all pass
    timeout_s: float = 0.0  # wall clock per sandboxed run; 0: the sandbox's configured limit

    def __post_init__(self) -> None:
        if not 0 <= self.timeout_s <= MAX_TIMEOUT_S:
            raise FieldError("grading.verifier_options.timeout_s", f"must be in [0, {MAX_TIMEOUT_S:g}], "
                             f"got {self.timeout_s}")


def options(task: Mapping[str, Any]) -> CodeOptions:
    return parse_options(CodeOptions, task.get("verifier_options"), "grading.verifier_options")


def extract_code(response: str) -> str:
    """The last ```python (or ```py) block; else the last unlabelled fenced block; else the whole response."""
    blocks = _FENCE.findall(response)
    for wanted in (lambda tag: tag.lower() in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return response


def task_field(task: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """`grading.<key>`, else `grading.row.<key>` (where a file dataset's per-row metadata object lands)."""
    if key in task:
        return task[key]
    row = task.get("row")
    return row.get(key, default) if isinstance(row, Mapping) else default


def task_language(task: Mapping[str, Any]) -> str:
    name = task_field(task, "language", "python")
    if not isinstance(name, str):
        raise FieldError("grading.language", f"must be a string, got {name!r}")
    try:
        language(name)
    except ValueError as exc:
        raise ValueError(f"grading.{exc}") from None
    return name


def required_text(task: Mapping[str, Any], key: str) -> str:
    value = task_field(task, key)
    if not isinstance(value, str) or not value.strip():
        raise FieldError(f"grading.{key}", "missing (a non-empty string, in grading or its row)")
    return value


class SandboxedVerifier:
    """Runs code in the sandbox, a subprocess: the caller's thread waits on it (the scorer calls non-isolated
    verifiers on a worker thread, never on the event loop), so no worker process is needed (`isolated` False).
    The sandbox is checked when the verifier is built: SandboxUnavailable (a RuntimeError) if bwrap cannot run."""

    isolated = False

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or shared_sandbox()

    def timeout(self, opts: CodeOptions) -> float | None:
        return opts.timeout_s or None
