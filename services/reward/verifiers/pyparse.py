"""`ast.parse` for verifiers, one parse at a time: CPython 3.11's AST constructor keeps its recursion depth in
per-interpreter state, so two threads parsing at once can fail with "SystemError: AST constructor recursion depth
mismatch" (python/cpython#106905), and the scorer runs verifiers on worker threads. Seen in a run: a code_tests
check failed that way and its message had to be redelivered."""

from __future__ import annotations

import ast
import threading

_ONE_AT_A_TIME = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    with _ONE_AT_A_TIME:
        return ast.parse(source, mode=mode)
