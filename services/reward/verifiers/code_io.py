"""`code_io`: the completion's program run on each stdin/stdout case in the sandbox (Codeforces style).

Task metadata (or a file dataset's `row`): `cases`, a list of `{"input": str, "output": str}`; `language` (default python). A case passes when
the program exits 0 within the deadline and its output has the same whitespace-separated tokens as `output`.
Options: `partial` (reward = the fraction of cases passed; else 1 only when all pass, stopping at the first
failure), `timeout_s` (per case).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.verifiers.base import Verdict
from services.reward.verifiers.code import SandboxedVerifier, extract_code, options, task_field, task_language

MAX_CASES = 100


def cases(task: Mapping[str, Any]) -> list[tuple[str, str]]:
    raw = task_field(task, "cases")
    if not isinstance(raw, list) or not raw:
        raise FieldError("grading.cases", "missing (a list of {input, output} maps)")
    if len(raw) > MAX_CASES:
        raise FieldError("grading.cases", f"at most {MAX_CASES}, got {len(raw)}")
    out = []
    for i, case in enumerate(raw):
        if not isinstance(case, Mapping):
            raise FieldError(f"grading.cases[{i}]", "must be a map with input and output")
        for key in ("input", "output"):
            if not isinstance(case.get(key), str):
                raise FieldError(f"grading.cases[{i}].{key}", "missing (a string)")
        if set(case) - {"input", "output"}:
            raise FieldError(f"grading.cases[{i}]", f"unknown keys {sorted(set(case) - {'input', 'output'})}")
        out.append((case["input"], case["output"]))
    return out


class CodeIOVerifier(SandboxedVerifier):
    name = "code_io"

    def check(self, task: Mapping[str, Any]) -> None:
        options(task)
        task_language(task)
        cases(task)

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        self.check(task)
        opts = options(task)
        code, lang, todo = extract_code(response), task_language(task), cases(task)
        passed, first_failure = 0, ""
        for i, (stdin, expected) in enumerate(todo):
            result = self.sandbox.run(code, stdin, lang, self.timeout(opts))
            if result.status == "ok" and result.stdout.split() == expected.split():
                passed += 1
                continue
            why = "wrong answer" if result.status == "ok" else result.status
            first_failure = first_failure or f"; case {i + 1}: {why}"
            if not opts.partial:
                break
        total = len(todo)
        reward = passed / total if opts.partial else float(passed == total)
        return Verdict(reward, f"{passed}/{total} cases passed{first_failure}")
