"""Replay guard: an SDK retry of a request (same session, same body, `x-stainless-retry-count` > 0) or a request
with an `Idempotency-Key` already seen gets the first attempt's result instead of a second interaction."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from services.rollout.gateway.errors import ApiError


def request_digest(path: str, body: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(path.rstrip("/").removeprefix("/v1").encode())
    h.update(b"\0")
    h.update(body)
    return h.hexdigest()


class ReplayCache:
    """(session id, key) -> future of the first attempt's result. Failed attempts are forgotten. At most
    `max_entries`: the oldest finished entries make room (a retry that late runs for real); when every entry is
    still running, `register` is 429."""

    def __init__(self, ttl_s: float, max_entries: int = 16384) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, session_id: str, key: str) -> asyncio.Future | None:
        entry = self._entries.get((session_id, key))
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            return None
        return entry[1]

    def register(self, session_id: str, key: str) -> asyncio.Future:
        self._entries.pop((session_id, key), None)  # re-inserted last: the dict stays in time order
        self._prune()
        if len(self._entries) >= self.max_entries:
            raise full(f"{len(self._entries)} requests are in flight for replay; the gateway holds at most "
                       f"{self.max_entries}")
        fut = asyncio.get_running_loop().create_future()
        self._entries[(session_id, key)] = (time.monotonic(), fut)
        return fut

    def resolve(self, session_id: str, key: str, fut: asyncio.Future, result: Any) -> None:
        if not fut.done():
            fut.set_result(result)

    def fail(self, session_id: str, key: str, fut: asyncio.Future) -> None:
        """The attempt recorded nothing: drop it so that a retry runs for real."""
        if self._entries.get((session_id, key), (0, None))[1] is fut:
            del self._entries[(session_id, key)]
        if not fut.done():
            fut.set_result(None)

    def forget_session(self, session_id: str) -> None:
        for k in [k for k in self._entries if k[0] == session_id]:
            del self._entries[k]

    def _prune(self) -> None:
        """Drop expired entries (the oldest come first), then the oldest finished ones past max_entries."""
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            k, (t, fut) = next(iter(self._entries.items()))
            if t >= cutoff and (len(self._entries) < self.max_entries or not fut.done()):
                break
            del self._entries[k]
        if len(self._entries) >= self.max_entries:  # the oldest is still running: drop finished ones after it
            excess = len(self._entries) - self.max_entries + 1
            for k in [k for k, (_, fut) in self._entries.items() if fut.done()][:excess]:
                del self._entries[k]


class IdempotencyCache:
    """Idempotency-Key -> the first call's result (a future while it runs), for `ttl_s`. A concurrent repeat waits
    for the first; a failed first call is forgotten (its repeat runs for real). At most `max_entries` keys within
    their TTL: past that, 429."""

    MAX_KEY_CHARS = 256

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, key: str) -> asyncio.Future | None:
        self._prune()
        entry = self._entries.get(key)
        return entry[1] if entry is not None else None

    def begin(self, key: str) -> asyncio.Future:
        self._prune()
        if len(self._entries) >= self.max_entries:
            raise full(f"{len(self._entries)} Idempotency-Keys were used in the last {self.ttl_s:g}s; "
                       f"the gateway remembers at most {self.max_entries}")
        fut = asyncio.get_running_loop().create_future()
        self._entries[key] = (time.monotonic(), fut)
        return fut

    def resolve(self, key: str, fut: asyncio.Future, result: Any) -> None:
        if not fut.done():
            fut.set_result(result)

    def fail(self, key: str, fut: asyncio.Future) -> None:
        if self._entries.get(key, (0, None))[1] is fut:
            del self._entries[key]
        if not fut.done():
            fut.set_result(None)

    def _prune(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            k, (t, fut) = next(iter(self._entries.items()))
            if t >= cutoff or not fut.done():
                break
            del self._entries[k]


def full(message: str) -> ApiError:
    return ApiError(429, message + "; retry later", code="rate_limit_exceeded",
                    headers={"retry-after": "5", "retry-after-ms": "5000"})
