"""The verifier pool's wait for a free worker is bounded: with every worker taken, a caller gets WorkerFailed (the
message is retried) within the pool's slot timeout instead of blocking its thread forever."""

from __future__ import annotations

import time

import pytest

from services.reward.verifiers.pool import VerifierPool, WorkerFailed


def test_no_free_worker_within_the_slot_timeout_fails_naming_the_pool():
    pool = VerifierPool(workers=0, slot_timeout_s=0.5)  # no slot will ever come free
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"no verifier worker of 0 free within 0.5s"):
        pool.score("math", "42", {"answer": "42"}, timeout_s=5.0)
    assert time.monotonic() - started < 10
