"""The weight benchmark's driver waits on its rank processes under deadlines: a rank that never answers fails the
case in seconds, naming the rank, what was awaited and what it printed instead (real child processes)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from services.weight_exchange.bench import runner

SILENT = "import sys, time; print('loading weights', flush=True); time.sleep(120)"


async def child(code: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)


async def test_a_rank_that_never_replies_fails_within_the_deadline_naming_it():
    proc = await child(SILENT)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"src-0: the ready line not seen within 2s \(last other output: "
                                               r"'loading weights'\)"):
            await runner._read_reply(proc, "src-0", 2.0, waiting_for="the ready line")
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        await asyncio.wait_for(proc.wait(), 30)


async def test_a_rank_that_exits_before_its_reply_is_named():
    proc = await child("print('ImportError: no ucxx', flush=True)")
    try:
        with pytest.raises(RuntimeError, match=r"dst-1 exited before the reply to 'peak' "
                                               r"\(last other output: 'ImportError: no ucxx'\)"):
            await runner._read_reply(proc, "dst-1", 30.0, waiting_for="the reply to 'peak'")
    finally:
        await asyncio.wait_for(proc.wait(), 30)


async def test_a_reply_after_other_output_is_returned():
    proc = await child(f"print('ucx: hello'); print({runner.MARK!r} + '{{\"ready\": \"src-0\"}}', flush=True)")
    try:
        assert await runner._read_reply(proc, "src-0", 30.0) == {"ready": "src-0"}
    finally:
        await asyncio.wait_for(proc.wait(), 30)
