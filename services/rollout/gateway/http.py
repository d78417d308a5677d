"""HTTP helpers: bounded JSON bodies, keys from headers, replay keys, errors in the caller's dialect."""

from __future__ import annotations

import json

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


async def read_json(request: Request, limit: int, *, allow_empty: bool = False) -> tuple[dict, bytes]:
    """The body as a JSON object; 413 past `limit` bytes (checked while reading, not only by Content-Length)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body is {length} bytes; the limit is {limit}", param="body", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", param="body", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if allow_empty:
            return {}, raw
        raise bad_request("body", "expected a JSON object, got an empty body")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"body: invalid JSON ({exc})", param="body", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("body", "expected a JSON object")
    return body, raw


def replay_key(request: Request, raw: bytes) -> ReplayKey:
    idem = request.headers.get("idempotency-key")
    if idem:
        return ReplayKey("idem:" + idem, True)
    retries = request.headers.get("x-stainless-retry-count", "0")
    return ReplayKey(request_digest(request.scope["path"], raw), retries.isdigit() and int(retries) > 0)
