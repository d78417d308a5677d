"""Turning a source's raw rows (dicts) into tasks, with the configured field names. No I/O.

Errors name where the row came from (``path:line`` for JSONL, ``path:row N`` otherwise) and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from services.builder.datasets.task import Task
from services.common.errors import FieldError

ROLES = ("system", "user", "assistant", "tool")


def plain(value: Any) -> Any:
    """``value`` made msgpack-serialisable: tuples and sets as lists, keys as strings, numpy scalars unwrapped,
    anything else unknown as its ``str``."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / pyarrow scalars
        return plain(value.item())
    if hasattr(value, "tolist"):
        return plain(value.tolist())
    return str(value)


def _answer(value: Any, where: str, field: str) -> str:
    if value is None:
        raise FieldError(where, f"missing field {field!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(where, f"field {field!r} must be a string or a number, got {type(value).__name__}")
    return str(value)


def _messages(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise FieldError(where, f"field {field!r} must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise FieldError(where, f"field {field}[{i}] must be an object with a role ({', '.join(ROLES)}) "
                             f"and a string content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def to_task(row: Any, *, where: str, task_id: str, fields: Mapping[str, str], grading: Mapping[str, Any]) -> Task:
    """One row as a task. ``fields`` maps prompt / messages / answer / verifier / metadata (and, for a preference
    dataset, chosen / rejected; the answer is then optional) to column names; ``grading`` holds the dataset's
    defaults (verifier, its options, shaping, extract)."""
    if not isinstance(row, Mapping):
        raise FieldError(where, f"a row must be a JSON object, got {type(row).__name__}")
    prompt, messages = row.get(fields["prompt"]), row.get(fields["messages"])
    if prompt is None and messages is None:
        raise FieldError(where, f"missing field {fields['prompt']!r} (or {fields['messages']!r})")
    if prompt is not None and messages is not None:
        raise FieldError(where, f"has both {fields['prompt']!r} and {fields['messages']!r}; give one")
    if prompt is not None and not isinstance(prompt, str):
        raise FieldError(where, f"field {fields['prompt']!r} must be a string, got {type(prompt).__name__}")
    metadata = {k: v for k, v in grading.items() if v not in (None, "", [], {})}
    verifier = row.get(fields["verifier"])
    if verifier is not None:
        if not isinstance(verifier, str) or not verifier:
            raise FieldError(where, f"field {fields['verifier']!r} must be a non-empty string")
        metadata["verifier"] = verifier
    extra = row.get(fields["metadata"])
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise FieldError(where, f"field {fields['metadata']!r} must be an object")
        metadata["row"] = plain(extra)
    pair: dict[str, str] = {}
    if "chosen" in fields:   # a preference dataset: every row holds a preferred and a dispreferred reply
        for key in ("chosen", "rejected"):
            value = row.get(fields[key])
            if not isinstance(value, str) or not value:
                raise FieldError(where, f"field {fields[key]!r} must be a non-empty string (a preference row)")
            pair[key] = value
        if pair["chosen"] == pair["rejected"]:
            raise FieldError(where, f"fields {fields['chosen']!r} and {fields['rejected']!r} are the same reply")
    answer = row.get(fields["answer"])
    answer = "" if pair and answer is None else _answer(answer, where, fields["answer"])
    images = row.get(fields.get("images", ""), None) or ()  # read into bytes by files.with_images
    if not isinstance(images, tuple) or not all(isinstance(b, bytes) for b in images):
        raise FieldError(where, f"field {fields['images']!r} must be a list of images")
    return Task(task_id=task_id, prompt=prompt or "", answer=answer,
                messages=None if messages is None else _messages(messages, where, fields["messages"]),
                metadata=metadata, images=images, **pair)


def to_tasks(rows: Iterable[tuple[str, Any]], *, prefix: str, fields: Mapping[str, str],
             grading: Mapping[str, Any]) -> list[Task]:
    """``rows`` as (where, row) pairs; task ids are ``prefix`` and the row's position, unique within a split."""
    return [to_task(row, where=where, task_id=f"{prefix}:{i}", fields=fields, grading=grading)
            for i, (where, row) in enumerate(rows)]
