"""Errors as data, rendered in the shape of the API that was called (OpenAI or Anthropic)."""

from __future__ import annotations

import dataclasses
from typing import Literal

Dialect = Literal["openai", "anthropic"]

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error", 504: "server_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 504: "api_error"}


@dataclasses.dataclass
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None          # the offending field, e.g. "messages[2].content"
    code: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


def bad_request(param: str, problem: str) -> ApiError:
    """400 naming the field: `messages[0].role: expected one of ...`."""
    return ApiError(400, f"{param}: {problem}", param=param, code="invalid_value")


def unsupported(param: str, why: str = "is not supported by this gateway") -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def error_body(err: ApiError, dialect: Dialect) -> dict:
    if dialect == "anthropic":
        kind = _ANTHROPIC_TYPES.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = _OPENAI_TYPES.get(err.status, "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_headers(err: ApiError) -> dict[str, str]:
    headers = dict(err.headers)
    if err.status in (400, 401, 403, 404, 409, 413):
        headers.setdefault("x-should-retry", "false")  # SDKs retry 409 by default; these cannot succeed on retry
    return headers
