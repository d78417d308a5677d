"""HTTP helpers: bounded JSON bodies, keys from headers, replay keys, errors in the caller's dialect."""

from __future__ import annotations

import json
import re

from starlette.requests import Request
from starlette.responses import Response

from services.rollout.gateway.core import ReplayKey
from services.rollout.gateway.dedupe import request_digest
from services.rollout.gateway.errors import ApiError, Dialect, bad_request, error_body, error_headers

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(), status_code=status,
                    media_type="application/json", headers=headers)


def dialect(path: str) -> Dialect:
    return "anthropic" if "/messages" in path else "openai"


def error_response(err: ApiError, path: str) -> Response:
    return json_response(error_body(err, dialect(path)), err.status, error_headers(err))


def api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key") or None


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; 413 past `limit` bytes (checked while reading, not only by Content-Length)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is {length} bytes; the limit is {limit}", param="body", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", param="body", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_json(raw: bytes, *, max_depth: int = 64, allow_empty: bool = False) -> dict:
    """A JSON object: 400 naming the body for invalid JSON or UTF-8, nesting deeper than `max_depth`, lone UTF-16
    surrogates or anything but an object (never a 500, whatever the bytes)."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise bad_request("body", "expected a JSON object, got an empty body")
    try:
        body = json.loads(raw.decode("utf-8"))  # NaN / Infinity parse: the field that gets one refuses it by name
    except RecursionError as exc:
        raise ApiError(400, f"body: JSON nested deeper than {max_depth} levels", param="body", code="invalid_json") from exc
    except ValueError as exc:
        raise ApiError(400, f"body: invalid JSON ({exc})", param="body", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("body", "expected a JSON object")
    _check_tree(body, max_depth, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _check_tree(body: dict, max_depth: int, *, strings: bool) -> None:
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise ApiError(400, f"body: JSON nested deeper than {max_depth} levels", param="body", code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if strings and isinstance(key, str):
                _text(key)
            if isinstance(item, dict | list):
                stack.append((item, depth + 1))
            elif strings and isinstance(item, str):
                _text(item)


def _text(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, "body: a string holds a lone UTF-16 surrogate (not valid Unicode text)", param="body",
                       code="invalid_json") from exc


async def read_json(request: Request, limit: int, *, allow_empty: bool = False, max_depth: int = 64) -> tuple[dict, bytes]:
    """The body as a JSON object (parsed on the loop: callers with large bodies use `load_json` off it)."""
    raw = await read_body(request, limit)
    return load_json(raw, max_depth=max_depth, allow_empty=allow_empty), raw


def replay_key(request: Request, raw: bytes) -> ReplayKey:
    idem = request.headers.get("idempotency-key")
    if idem:
        return ReplayKey("idem:" + idem, True)
    retries = request.headers.get("x-stainless-retry-count", "0")
    return ReplayKey(request_digest(request.scope["path"], raw), retries.isdigit() and int(retries) > 0)
