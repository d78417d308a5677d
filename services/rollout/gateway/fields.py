"""Reading request fields with errors that name the field (`messages[2].content: expected a string`)."""

from __future__ import annotations

import math
from typing import Any

from services.rollout.gateway.errors import bad_request, unsupported

_MISSING = object()


def obj(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise bad_request(path, f"expected an object, got {_kind(value)}")
    return value


def req(body: dict, key: str, path: str = "") -> Any:
    if key not in body or body[key] is None:
        raise bad_request(_join(path, key), "field required")
    return body[key]


def string(body: dict, key: str, path: str = "", *, default: Any = _MISSING, allow_empty: bool = True) -> Any:
    value = body.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise bad_request(_join(path, key), "field required")
        return default
    if not isinstance(value, str):
        raise bad_request(_join(path, key), f"expected a string, got {_kind(value)}")
    if not allow_empty and not value:
        raise bad_request(_join(path, key), "must not be empty")
    return value


def number(body: dict, key: str, path: str = "", *, default: float, lo: float | None = None,
           hi: float | None = None, lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(_join(path, key), f"expected a number, got {_kind(value)}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise bad_request(_join(path, key), f"must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_request(_join(path, key), f"must be <= {hi}, got {value}")
    return float(value)


def integer(body: dict, key: str, path: str = "", *, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(_join(path, key), f"expected an integer, got {_kind(value)}")
    if lo is not None and value < lo:
        raise bad_request(_join(path, key), f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise bad_request(_join(path, key), f"must be <= {hi}, got {value}")
    return value


def boolean(body: dict, key: str, path: str = "", *, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(_join(path, key), f"expected true or false, got {_kind(value)}")
    return value


def array(body: dict, key: str, path: str = "", *, default: Any = _MISSING, non_empty: bool = False) -> Any:
    value = body.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise bad_request(_join(path, key), "field required")
        return default
    if not isinstance(value, list):
        raise bad_request(_join(path, key), f"expected an array, got {_kind(value)}")
    if non_empty and not value:
        raise bad_request(_join(path, key), "must not be empty")
    return value


def stop_list(body: dict, key: str, *, max_items: int = 16) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(key, "expected a string or an array of strings")
    if len(items) > max_items:
        raise bad_request(key, f"at most {max_items} stop sequences, got {len(items)}")
    return [s for s in items if s]


def check_keys(body: dict, known: frozenset[str], ignored: frozenset[str], *, strict: bool, path: str = "") -> None:
    """Unknown fields are 400 when `strict`; `ignored` fields are accepted and have no effect."""
    if not strict:
        return
    for key in body:
        if key not in known and key not in ignored:
            raise unsupported(_join(path, key), "unrecognized request argument")


def reject_if(body: dict, key: str, ok, why: str) -> None:
    """400 for a parameter whose value the gateway cannot honour (e.g. logit_bias, top_logprobs > 0)."""
    if key in body and body[key] is not None and not ok(body[key]):
        raise unsupported(key, why)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)
