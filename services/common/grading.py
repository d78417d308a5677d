"""The grading of a task: a dataset's metadata map ↔ the typed ``Grading`` message ↔ the map verifiers read. No I/O.

Verifiers (built-in and plugins) keep reading a plain map with the keys below; only the wire is typed. The typed
keys are checked where the message is built, so a wrong type fails in the builder (or the Score caller), naming
the key, instead of as a dead letter in the reward service.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from services.common.contracts import data_pb2
from services.common.errors import FieldError

TEXT_KEYS = ("answer", "question", "verifier", "extract", "response")
MAP_KEYS = ("verifier_options", "rg_entry", "row")
KEYS = (*TEXT_KEYS, *MAP_KEYS, "shaping", "eval_round", "add_reward")
RESPONSES = ("completion", "final_turn")  # what `response` may name (unset: the whole completion)


def to_proto(task: Mapping[str, Any], field: str = "grading") -> data_pb2.Grading:
    """``task``: the map a dataset builds (the keys above; any other key is a verifier's own and travels in
    ``extra``). ValueError naming ``field.<key>`` for a value of the wrong type."""
    g = data_pb2.Grading()
    for key in TEXT_KEYS:
        value = task.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise FieldError(f"{field}.{key}", f"must be a string, got {type(value).__name__}")
            setattr(g, key, value)
    if g.response and g.response not in RESPONSES:
        raise FieldError(f"{field}.response", f"must be one of {', '.join(RESPONSES)}, got {g.response!r}")
    if task.get("add_reward") is not None:
        if not isinstance(task["add_reward"], bool):
            raise FieldError(f"{field}.add_reward", f"must be a boolean, got {type(task['add_reward']).__name__}")
        g.add_reward = task["add_reward"]
    for key in MAP_KEYS:
        if task.get(key) is not None:
            setattr(g, key, _pack_map(task[key], f"{field}.{key}"))
    g.shaping.extend(_shaping(task.get("shaping"), f"{field}.shaping"))
    if task.get("eval_round") is not None:
        if isinstance(task["eval_round"], bool) or not isinstance(task["eval_round"], int):
            raise FieldError(f"{field}.eval_round", "must be an integer")
        g.eval_round = task["eval_round"]
    extra = {k: v for k, v in task.items() if k not in KEYS}
    if extra:
        g.extra = _pack_map(extra, f"{field}.extra")
    return g


def to_task(g: data_pb2.Grading, field: str = "grading") -> dict[str, Any]:
    """The map verifiers read (the keys of ``to_proto``'s input). ValueError naming the field for a part that is
    not a msgpack map."""
    task: dict[str, Any] = _unpack_map(g.extra, f"{field}.extra") if g.extra else {}
    task.update({key: getattr(g, key) for key in TEXT_KEYS if getattr(g, key)})
    task.update({key: _unpack_map(getattr(g, key), f"{field}.{key}") for key in MAP_KEYS if getattr(g, key)})
    if g.shaping:
        task["shaping"] = [{**_unpack_map(t.options, f"{field}.shaping[{i}].options"), "name": t.name}
                           for i, t in enumerate(g.shaping)]
    if g.HasField("eval_round"):
        task["eval_round"] = g.eval_round
    if g.add_reward:
        task["add_reward"] = True
    return task


def eval_round(g: data_pb2.Grading) -> int:
    """The evaluation round the work belongs to; -1 on training work."""
    return g.eval_round if g.HasField("eval_round") else -1


def _shaping(terms: Any, field: str) -> list[data_pb2.ShapingTerm]:
    if terms is None:
        return []
    if not isinstance(terms, list | tuple):
        raise FieldError(field, "must be a list of maps, each with a name")
    out = []
    for i, term in enumerate(terms):
        if not isinstance(term, Mapping) or not isinstance(term.get("name"), str):
            raise FieldError(f"{field}[{i}]", "must be a map with a string name")
        options = {k: v for k, v in term.items() if k != "name"}
        out.append(data_pb2.ShapingTerm(name=term["name"], options=_pack_map(options, f"{field}[{i}]")))
    return out


def _pack_map(value: Any, field: str) -> bytes:
    if not isinstance(value, Mapping):
        raise FieldError(field, f"must be a map, got {type(value).__name__}")
    try:
        return msgpack.packb(dict(value), use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise FieldError(field, f"cannot be serialised ({exc})") from exc


def _unpack_map(raw: bytes, field: str) -> dict[str, Any]:
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - whatever msgpack refuses, the field is unreadable
        raise FieldError(field, f"not msgpack ({exc})") from exc
    if not isinstance(value, dict):
        raise FieldError(field, "must be a msgpack map")
    return value
