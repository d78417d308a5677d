"""Held-out splits, per-epoch shuffling and the prompt-length filter. No I/O."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

from services.builder.datasets.task import Task
from services.common.errors import FieldError


def hold_out(tasks: Sequence[Task], fraction: float, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, eval): ``fraction`` of the tasks, drawn with ``seed``, held out; both keep the source order."""
    if not 0.0 < fraction < 1.0:
        raise FieldError("eval_fraction", f"must be between 0 and 1, got {fraction}")
    n_eval = round(len(tasks) * fraction)
    if n_eval < 1 or n_eval >= len(tasks):
        raise FieldError("eval_fraction", f"{fraction} of {len(tasks)} rows leaves an empty train or eval split")
    held = set(random.Random(seed).sample(range(len(tasks)), n_eval))
    return ([t for i, t in enumerate(tasks) if i not in held], [t for i, t in enumerate(tasks) if i in held])


def shuffled_epochs(tasks: Sequence[Task], seed: int) -> Iterator[Task]:
    """Cycle over ``tasks`` forever, reshuffled every epoch; the same sequence for the same seed."""
    if not tasks:
        raise FieldError("dataset", "the train split is empty")
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def filter_length(tasks: Sequence[Task], count_tokens: Callable[[Task], int], max_tokens: int) -> tuple[list[Task], int]:
    """(kept, number dropped): tasks whose rendered prompt has more than ``max_tokens`` tokens are dropped
    (``max_tokens`` 0: keep all, without counting)."""
    if max_tokens <= 0:
        return list(tasks), 0
    kept = [t for t in tasks if count_tokens(t) <= max_tokens]
    return kept, len(tasks) - len(kept)
