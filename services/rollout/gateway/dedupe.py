"""Replay guard: an SDK retry of a request (same session, same body, `x-stainless-retry-count` > 0) or a request
with an `Idempotency-Key` already seen gets the first attempt's result instead of a second interaction."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any


def request_digest(path: str, body: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(path.rstrip("/").removeprefix("/v1").encode())
    h.update(b"\0")
    h.update(body)
    return h.hexdigest()


class ReplayCache:
    """(session id, key) -> future of the first attempt's result. Failed attempts are forgotten."""

    def __init__(self, ttl_s: float, max_entries: int = 65536) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str], tuple[float, asyncio.Future]] = {}

    def lookup(self, session_id: str, key: str) -> asyncio.Future | None:
        entry = self._entries.get((session_id, key))
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            return None
        return entry[1]

    def register(self, session_id: str, key: str) -> asyncio.Future:
        self._prune()
        fut = asyncio.get_running_loop().create_future()
        self._entries.pop((session_id, key), None)  # re-inserted last: the dict stays in time order
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
        """Drop expired entries (the oldest come first), and the oldest finished ones past max_entries."""
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            k, (t, fut) = next(iter(self._entries.items()))
            if t >= cutoff and (len(self._entries) < self.max_entries or not fut.done()):
                break
            del self._entries[k]
