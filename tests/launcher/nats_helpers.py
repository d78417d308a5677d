"""Helpers for tests that talk to nats-servers they kill and restart."""

from __future__ import annotations

import asyncio
import time


async def quiet(*_args) -> None:
    """An error callback that keeps expected reconnect errors out of the test output."""
    return None


async def retry(make, timeout: float = 45.0):
    """Call `make()` until it succeeds (a leader election or a client reconnect takes a few seconds; in the full
    suite on 2 cores one publish after a leader's death once took more than 15 s)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await make()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
