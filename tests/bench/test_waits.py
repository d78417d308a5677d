"""The benchmarks' waits on their child processes are bounded: a child that hangs fails the benchmark in seconds
with an error naming what it waited for (real processes, no mocks)."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from bench.gateway import Agent
from bench.trl_window import run_measured


def test_a_measured_run_past_its_timeout_is_stopped_and_named():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not finish within 1s \(stopped"):
        run_measured([sys.executable, "-c", "import time; time.sleep(120)"], cpus=None, timeout=1.0)
    assert time.monotonic() - started < 30


def test_a_measured_run_that_finishes_is_timed():
    measured = run_measured([sys.executable, "-c", "pass"], cpus=None, timeout=120.0)
    assert 0 < measured.seconds < 120 and measured.peak_rss_bytes >= 0


async def test_an_agent_case_that_gets_no_answer_fails_within_the_agents_timeout():
    """The gateway accepts connections but never answers (a listening socket nobody reads): the agent process's
    request hangs under httpx's 120-s timeout, the driver gives up at its own 3 s."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        agent = Agent(timeout=3.0)
        await agent.start()
        started = time.monotonic()
        try:
            with pytest.raises(TimeoutError, match=r"no result for the 'latency' case within 3s"):
                await agent.run({"kind": "latency", "url": url, "body": {}, "n": 1, "warmup": 0})
            assert time.monotonic() - started < 30
        finally:
            await agent.close(timeout=5.0)  # stuck in that request: killed
        assert agent.proc.returncode is not None
