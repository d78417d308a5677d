"""`code_tests`: the completion's code run against the task's unit tests in the sandbox (human-eval style).

Task metadata (or a file dataset's `row`): `tests` (code; with `entry_point`, it defines `check(candidate)`, called with the function named
`entry_point`; without, plain statements such as asserts run after the code), optional `code_prefix` (prepended
when the code does not define `entry_point`: human-eval's prompt, the signature and docstring), `language`.
Options: `partial` (reward = the fraction of separable tests passed: each top-level assert of `check`'s body, or
of `tests`), `timeout_s`.

The code cannot reach its grader: in the sandbox the tests run in a judge process, and the code runs in a process of
its own that only answers calls with plain data (code_tests_harness.py). Values are compared in the judge as builtin
values, so an object "equal to everything" fails. The service counts the cases (`total`) and clamps `passed`.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import pathlib
import re
import secrets
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError
from services.reward.verifiers import pyparse
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
# the program run in the sandbox: a judge process that holds the nonce and the tests and runs the tests, and the
# candidate's code in a process of its own that only answers calls with plain data (see the harness's docstring)
HARNESS = (pathlib.Path(__file__).parent / "code_tests_harness.py").read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the judge runs the tests: `setup` once, then each case; `total` asserts count. `param` is the name
    `check` calls its candidate (the entry point is bound to it); `names` are the names the tests use without
    binding them, which the judge takes from the solution (the entry point, prompt helpers)."""

    setup: str
    cases: list[tuple[str, str]]  # (kind, source): kind "assert" counts; a failing "stmt" ends the run
    param: str | None
    names: list[str]
    total: int


def plan(tests: str, entry: str | None, partial: bool) -> Plan:
    """The cases of `tests`, split when `partial` and they split (each top-level assert of `check`'s body, or of
    the tests); else one case, all the tests. Computed here, so the sandbox never decides `total`."""
    module = pyparse.parse(tests)
    names = sorted(_free_names(module))
    split = _split(module, entry) if partial else None
    if split is None:
        whole = [("assert", "check(__candidate__)" if entry is not None else tests)]
        return Plan(tests if entry is not None else "", whole, None, names, 1)
    setup, cases, param = split
    return Plan(setup, cases, param, names, sum(kind == "assert" for kind, _ in cases))


def _split(module: ast.Module, entry: str | None) -> tuple[str, list[tuple[str, str]], str | None] | None:
    body, setup, param = module.body, [], None
    if entry is not None:
        checks = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == "check"]
        if not checks or not checks[-1].args.args:
            return None
        setup = [n for n in body if n is not checks[-1]]
        body, param = checks[-1].body, checks[-1].args.args[0].arg
    cases = [("assert" if isinstance(node, ast.Assert) else "stmt", ast.unparse(node)) for node in body]
    if not any(kind == "assert" for kind, _ in cases):
        return None
    return ast.unparse(ast.Module(setup, type_ignores=[])), cases, param


def _free_names(module: ast.Module) -> set[str]:
    """Names the tests read but never bind anywhere, builtins aside (an over-approximation: binding one that is
    local is harmless). The judge drops any that are builtins of the sandbox's interpreter too."""
    read, bound = set(), set()
    for node in ast.walk(module):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return read - bound - set(dir(builtins))


class CodeTestsVerifier(SandboxedVerifier):
    name = "code_tests"

    def check(self, task: Mapping[str, Any]) -> None:
        options(task)
        if task_language(task) != "python":
            raise FieldError("grading.language", "code_tests runs Python tests only")
        try:
            pyparse.parse(required_text(task, "tests"))
        except SyntaxError as exc:
            raise FieldError("grading.tests", f"not valid Python ({exc.msg}, line {exc.lineno})") from None
        entry = task_field(task, "entry_point")
        if entry is not None and not (isinstance(entry, str) and _IDENTIFIER.fullmatch(entry)):
            raise FieldError("grading.entry_point", f"must be a function name, got {entry!r}")
        if not isinstance(task_field(task, "code_prefix", ""), str):
            raise FieldError("grading.code_prefix", "must be a string")

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        self.check(task)
        opts = options(task)
        entry = task_field(task, "entry_point")
        code = extract_code(response)
        prefix = task_field(task, "code_prefix", "")
        if entry and prefix and not re.search(rf"^\s*def\s+{entry}\s*\(", code, re.M):
            code = prefix + code  # a completion that continues the prompt's signature
        the_plan = plan(task_field(task, "tests"), entry, opts.partial)
        nonce = secrets.token_hex(16)
        result = self.sandbox.run(HARNESS, _stdin(nonce, code, entry, the_plan), timeout_s=self.timeout(opts))
        report = _report(result.stdout, nonce)
        passed = report.get("passed") if report is not None else None
        if type(passed) is not int:
            return Verdict(0.0, f"no test verdict ({result.status}, exit {result.exit_code}): "
                                f"{result.stderr.strip()[-300:]}")
        total = the_plan.total
        passed = min(max(passed, 0), total)  # the judge is ours, but a verdict off the plan is never trusted
        reward = passed / total if opts.partial else float(passed == total)
        error = f": {str(report.get('error'))[-300:]}" if report.get("error") else ""
        return Verdict(reward, f"{passed}/{total} tests passed{error}")


def _stdin(nonce: str, code: str, entry: str | None, the_plan: Plan) -> str:
    return json.dumps({"nonce": nonce, "solution": code, "entry": entry, "plan": dataclasses.asdict(the_plan)})


def _report(stdout: str, nonce: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                report = json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
            return report if isinstance(report, dict) else None
    return None
