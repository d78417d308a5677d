"""Process rewards for worked arithmetic: every line that states `<expression> = <number>` is a step.

A step earns 1 when its expression (numbers, + - * /, parentheses) evaluates to the number it claims, else 0; a last
step, at the end of the response, earns 1 when the final answer (`grading.extract`, default the last number) equals
`grading.answer`. The outcome reward is the final answer's, as `math` gives it, so outcome presets train on the same
tasks; `reward_level: process` presets (`grpo_process`) train on the steps.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Mapping
from typing import Any

from services.reward.verifiers import pyparse
from services.reward.verifiers.base import (
    NoOptions,
    StepVerdict,
    Verdict,
    check_task,
    extract,
    parse_options,
    reference_answer,
)

# the right-most `lhs = number` of a line; the left side is what precedes it on the line after any words
_EQUATION = re.compile(r"([-+*/().\d\s]*\d[-+*/().\d\s]*)=\s*(-?\d+(?:\.\d+)?)\s*[.,;]?\s*$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION = 200      # characters: bounds the work per line
MAX_MAGNITUDE = 1e15


def evaluate(expression: str) -> float | None:
    """The value of a plain arithmetic expression, or None when it is not one (or divides by zero, or its values
    leave +-1e15). No names, calls or powers are evaluated: only numbers and + - * / and parentheses."""
    if len(expression) > MAX_EXPRESSION:
        return None
    try:
        tree = pyparse.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out = float(node.value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError(type(node).__name__)
        if not math.isfinite(out) or abs(out) > MAX_MAGNITUDE:
            raise ValueError("out of range")
        return out

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError):
        return None


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


class ArithmeticChainVerifier:
    name = "arithmetic_chain"
    isolated = False      # bounded work per line (MAX_EXPRESSION), no symbolic engine

    def check(self, task: Mapping[str, Any]) -> None:
        check_task(task)
        parse_options(NoOptions, task.get("verifier_options"), "grading.verifier_options")
        extract(" ", str(task.get("extract", "last_number")))   # an unknown mode names grading.extract

    def score(self, response: str, task: Mapping[str, Any]) -> Verdict:
        steps, offset, checked, right = [], 0, 0, 0
        for line in response.splitlines(keepends=True):
            end = offset + len(line.rstrip("\r\n"))
            offset += len(line)
            found = _EQUATION.search(line.rstrip("\r\n"))
            if found is None:
                continue
            value = evaluate(found.group(1))
            ok = value is not None and _same(value, float(found.group(2)))
            steps.append(StepVerdict(end, 1.0 if ok else 0.0))
            checked, right = checked + 1, right + ok
        gold = reference_answer(task)
        answer = extract(response, str(task.get("extract", "last_number")))
        final = answer is not None and _numbers_equal(answer, gold)
        steps.append(StepVerdict(len(response), 1.0 if final else 0.0))
        return Verdict(1.0 if final else 0.0, f"{right}/{checked} steps right; answer {answer!r} vs {gold!r}",
                       tuple(steps))


def _numbers_equal(answer: str, gold: str) -> bool:
    try:
        return _same(float(answer), float(gold))
    except ValueError:
        return answer.strip() == gold.strip()
