"""`code_tests`: the completion's code run against the task's unit tests in the sandbox (human-eval style).

Task metadata (or a file dataset's `row`): `tests` (code; with `entry_point`, it defines `check(candidate)`, called with the function named
`entry_point`; without, plain statements such as asserts run after the code), optional `code_prefix` (prepended
when the code does not define `entry_point`: human-eval's prompt, the signature and docstring), `language`.
Options: `partial` (reward = the fraction of separable tests passed: each top-level assert of `check`'s body, or
of `tests`), `timeout_s`.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import Verdict
from services.reward.verifiers.code import (
    SandboxedVerifier,
    extract_code,
    options,
    required_text,
    task_field,
    task_language,
)

_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")

# Runs inside the sandbox. The verdict line starts with a nonce read from stdin before the candidate runs, so the
# candidate cannot print a forged verdict, and exiting early (sys.exit(0), os._exit) scores nothing.
HARNESS = r'''
import ast, json, os, sys, traceback
_NONCE = sys.stdin.readline().strip()
_OUT = os.fdopen(os.dup(1), "w")
SOLUTION, TESTS, ENTRY, PARTIAL = {solution!r}, {tests!r}, {entry!r}, {partial!r}


def _report(passed, total, error=""):
    _OUT.write(_NONCE + " " + json.dumps({{"passed": passed, "total": total, "error": error[-2000:]}}) + "\n")
    _OUT.flush()
    os._exit(0)


def _why(exc):
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _cases():
    """(setup statements, [(kind, compiled)]) with kind "assert" or "stmt"; None when the tests do not split."""
    module = ast.parse(TESTS)
    body, setup, param = module.body, [], None
    if ENTRY is not None:
        checks = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == "check"]
        if not checks or not checks[-1].args.args:
            return None
        setup = [n for n in body if n is not checks[-1]]
        body, param = checks[-1].body, checks[-1].args.args[0].arg
    cases = []
    for node in body:
        kind = "assert" if isinstance(node, ast.Assert) else "stmt"
        cases.append((kind, compile(ast.Module([node], type_ignores=[]), "tests.py", "exec")))
    if not any(kind == "assert" for kind, _ in cases):
        return None
    return compile(ast.Module(setup, type_ignores=[]), "tests.py", "exec"), cases, param


def main():
    ns = {{"__name__": "solution"}}
    split = _cases() if PARTIAL else None
    total = sum(kind == "assert" for kind, _ in split[1]) if split else 1
    try:
        exec(compile(SOLUTION, "solution.py", "exec"), ns)
        if ENTRY is not None and ENTRY not in ns:
            _report(0, total, "the code does not define " + ENTRY)
    except BaseException as exc:
        _report(0, total, "solution: " + _why(exc))
    if split is None:
        try:
            exec(compile(TESTS, "tests.py", "exec"), ns)
            if ENTRY is not None:
                ns["check"](ns[ENTRY])
        except BaseException as exc:
            _report(0, 1, _why(exc))
        _report(1, 1)
    setup, cases, param = split
    passed, first_error = 0, ""
    try:
        exec(setup, ns)
        if param is not None:
            ns[param] = ns[ENTRY]
    except BaseException as exc:
        _report(0, total, "tests: " + _why(exc))
    for kind, code in cases:
        try:
            exec(code, ns)
            passed += kind == "assert"
        except BaseException as exc:
            first_error = first_error or _why(exc)
            if kind == "stmt":
                break
    _report(passed, total, first_error)


main()
'''


def program(solution: str, tests: str, entry: str | None, partial: bool) -> str:
    return HARNESS.format(solution=solution, tests=tests, entry=entry, partial=partial)


class CodeTestsVerifier(SandboxedVerifier):
    name = "code_tests"

    def check(self, task: Mapping[str, Any]) -> None:
        options(task)
        if task_language(task) != "python":
            raise ValueError("metadata.language: code_tests runs Python tests only")
        try:
            ast.parse(required_text(task, "tests"))
        except SyntaxError as exc:
            raise ValueError(f"metadata.tests: not valid Python ({exc.msg}, line {exc.lineno})") from None
        entry = task_field(task, "entry_point")
        if entry is not None and not (isinstance(entry, str) and _IDENTIFIER.fullmatch(entry)):
            raise ValueError(f"metadata.entry_point: must be a function name, got {entry!r}")
        if not isinstance(task_field(task, "code_prefix", ""), str):
            raise ValueError("metadata.code_prefix: must be a string")

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        self.check(task)
        opts = options(task)
        entry = task_field(task, "entry_point")
        code = extract_code(response)
        prefix = task_field(task, "code_prefix", "")
        if entry and prefix and not re.search(rf"^\s*def\s+{entry}\s*\(", code, re.M):
            code = prefix + code  # a completion that continues the prompt's signature
        nonce = secrets.token_hex(16)
        result = self.sandbox.run(program(code, task_field(task, "tests"), entry, opts.partial), nonce + "\n",
                                  timeout_s=self.timeout(opts))
        report = _report(result.stdout, nonce)
        if report is None:
            return Verdict(0.0, f"no test verdict ({result.status}, exit {result.exit_code}): "
                                f"{result.stderr.strip()[-300:]}")
        passed, total = int(report["passed"]), max(1, int(report["total"]))
        reward = passed / total if opts.partial else float(passed == total)
        error = f": {report['error'][-300:]}" if report.get("error") else ""
        return Verdict(reward, f"{passed}/{total} tests passed{error}")


def _report(stdout: str, nonce: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                return json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
    return None
