"""Procedurally generated integer arithmetic: ``a+b=`` -> ``c``.

Pure Python, no I/O. A problem belongs to the ``train`` or the ``eval`` split by a hash of its text,
so the two splits never share a problem whatever the seed; each split is deterministic per seed.

The answer is a plain integer (the form ``math_verify`` handles most reliably). A completion is
just the digits of the sum; ``extract_answer`` takes the last integer in the completion, so a
verbose model ("the answer is 47") is still graded on correctness, not on format.
"""

from __future__ import annotations

import hashlib
import random
import re

from services.builder.datasets.task import Task

SPLITS = ("train", "eval")
# Operands are drawn uniformly from [MIN_OPERAND, MAX_OPERAND].
MIN_OPERAND = 0
MAX_OPERAND = 99
# One problem in EVAL_MODULUS belongs to the eval split (decided by a hash of the problem).
EVAL_MODULUS = 10

_INT_RE = re.compile(r"-?\d+")
# How the reward service grades a completion: the last integer in it, checked with math-verify.
GRADING = {"verifier": "math", "extract": "last_number"}


def _problem_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def split_of(a: int, b: int) -> str:
    """The split a problem belongs to: a pure function of the problem."""
    digest = hashlib.sha256(_problem_text(a, b).encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_MODULUS == 0 else "train"


def make_task(a: int, b: int) -> Task:
    return Task(task_id=f"add-{a}-{b}", prompt=_problem_text(a, b), answer=str(a + b), metadata=dict(GRADING))


def generate_split(split: str, num: int, seed: int) -> list[Task]:
    """``num`` distinct problems of ``split`` ("train" or "eval"), deterministic per ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(f"arithmetic/{split}/{seed}")
    seen: set[tuple[int, int]] = set()
    tasks: list[Task] = []
    # The eval split holds ~1/EVAL_MODULUS of the 1M problems; stop if asked for more than exist.
    capacity = (MAX_OPERAND - MIN_OPERAND + 1) ** 2
    max_draws = 50 * max(num, 1) + 10_000
    draws = 0
    while len(tasks) < num:
        draws += 1
        if draws > max_draws or len(seen) >= capacity:
            raise ValueError(f"num={num} is more than split {split!r} can supply")
        a = rng.randint(MIN_OPERAND, MAX_OPERAND)
        b = rng.randint(MIN_OPERAND, MAX_OPERAND)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        if split_of(a, b) != split:
            continue
        tasks.append(make_task(a, b))
    return tasks


def demonstration(task: Task) -> str:
    """The target completion for SFT (without EOS)."""
    return task.answer


def extract_answer(completion: str) -> str | None:
    """The last integer in the completion, or None when there is none."""
    found = _INT_RE.findall(completion)
    return found[-1] if found else None
