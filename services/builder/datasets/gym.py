"""reasoning-gym task families, generated offline (the package is imported only when used).

A family's entries are ``{"question", "answer", "metadata"}``; each becomes a task whose metadata carries the
entry (``rg_entry``, made msgpack-serialisable) so the reward service can call the family's own scorer.
"""

from __future__ import annotations

from typing import Any

from services.builder.datasets.rows import plain
from services.builder.datasets.task import Task
from services.common.errors import FieldError

# The eval split is generated with the seed moved this far, so its entries are not the train split's.
EVAL_SEED_OFFSET = 1_000_003


def families() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def generate(family: str, options: dict[str, Any], *, size: int, seed: int, split: str,
             grading: dict[str, Any]) -> list[Task]:
    """``size`` entries of ``family`` for ``split`` ("train" or "eval"), deterministic per ``seed``."""
    import reasoning_gym

    known = families()
    if family not in known:
        raise FieldError("dataset.family", f"unknown reasoning-gym family {family!r} (known: {', '.join(known)})")
    for key in ("seed", "size"):
        if key in options:
            raise FieldError(f"dataset.options.{key}", "set by the builder (run seed, train_size / eval_size)")
    if size < 1:
        raise FieldError(f"{split}_size", f"must be >= 1 for a reasoning-gym dataset, got {size}")
    if split == "eval":
        seed += EVAL_SEED_OFFSET
    try:
        dataset = reasoning_gym.create_dataset(family, seed=seed, size=size, **options)
    except TypeError as exc:  # an option the family's config does not have
        raise FieldError("dataset.options", f"{exc}") from exc
    except AssertionError as exc:  # families validate their options with asserts
        raise FieldError("dataset.options", f"rejected by {family!r}: {exc}") from exc
    tasks = []
    for i, entry in enumerate(dataset):
        rg_entry = plain({"question": entry["question"], "answer": entry["answer"],
                          "metadata": entry.get("metadata", {})})
        answer = "" if entry["answer"] is None else str(entry["answer"])
        tasks.append(Task(task_id=f"{family}-{split}-{i}", prompt=entry["question"], answer=answer,
                          metadata={**grading, "rg_entry": rg_entry}))
    return tasks
