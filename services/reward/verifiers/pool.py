"""Verifiers that may run for unbounded time (math-verify's symbolic checks) run in worker processes with a
deadline: past it the worker is killed and replaced, and the verification scores 0 with the reason. Callers
block their own thread only (`score`), or not at all (`score_async`: a worker thread waits), never the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from services.common.errors import FieldError
from services.reward.verifiers.base import StepVerdict, Verdict
from services.reward.verifiers.worker import HEADER

ROOT = pathlib.Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 180.0   # a worker imports sympy & co. before it is ready; slow on a busy machine


class WorkerFailed(RuntimeError):
    """A worker could not be started (not the item's fault: the message is retried, not scored)."""


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-m", "services.reward.verifiers.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=ROOT)
        self._buffer = b""
        self.loaded = {"math"}  # the worker imports math-verify before it says it is ready
        if self._read(time.monotonic() + START_TIMEOUT_S) != ["ready"]:
            self.kill()
            raise WorkerFailed(f"a verifier worker did not start within {START_TIMEOUT_S:g}s")

    def call(self, request: list, timeout_s: float) -> list | None:
        """The worker's reply; None when it did not answer within `timeout_s` (the caller kills it)."""
        data = msgpack.packb(request, use_bin_type=True)
        self.proc.stdin.write(HEADER.pack(len(data)) + data)
        self.proc.stdin.flush()
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline: float) -> list | None:
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                if len(self._buffer) >= HEADER.size:
                    (size,) = HEADER.unpack(self._buffer[:HEADER.size])
                    if len(self._buffer) >= HEADER.size + size:
                        frame = self._buffer[HEADER.size:HEADER.size + size]
                        self._buffer = self._buffer[HEADER.size + size:]
                        return msgpack.unpackb(frame, raw=False, strict_map_key=False)
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError("the verifier worker exited")
                self._buffer += chunk

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class VerifierPool:
    """`slot_timeout_s`: how long a caller waits for a free worker (each holder is bounded by the start, load and
    verification deadlines; past it the caller gets WorkerFailed, so the message is retried, not left hanging)."""

    def __init__(self, workers: int = 2, slot_timeout_s: float = 900.0) -> None:
        self.size = workers
        self.slot_timeout_s = slot_timeout_s
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # a slot; its worker starts on first use
        self.timeouts = 0
        self.restarts = 0

    def score(self, verifier: str, response: str, task: Mapping[str, Any], timeout_s: float) -> Verdict:
        """The verdict within `timeout_s` of the worker starting on it; else 0 with the reason. ValueError: the task
        itself is invalid (as the verifier said). A worker first loads a verifier (imports, plugin code, a
        reasoning-gym scorer) under the start deadline, so loading never counts against a verification's."""
        try:
            worker = self._idle.get(timeout=self.slot_timeout_s)
        except queue.Empty:
            raise WorkerFailed(f"no verifier worker of {self.size} free within {self.slot_timeout_s:g}s") from None
        try:
            if worker is None:
                worker = _Worker()
            if verifier not in worker.loaded:
                reply = self._call(worker, ["load", verifier], START_TIMEOUT_S)
                if reply is None or reply[0] == "crashed":
                    worker = None
                    why = reply[1] if reply else f"no answer within {START_TIMEOUT_S:g}s"
                    raise WorkerFailed(f"a verifier worker could not load {verifier!r}: {why}")
                if reply[0] == "invalid":
                    raise ValueError(str(reply[1]))
                if reply[0] != "ok":
                    raise FieldError("verifier", f"{verifier!r} does not load in a worker: {reply[1]}")
                worker.loaded.add(verifier)
            reply = self._call(worker, ["score", verifier, response, dict(task)], timeout_s)
            if reply is None:
                worker = None
                self.timeouts += 1
                return Verdict(0.0, f"timeout: verification took longer than {timeout_s:g}s")
            if reply[0] == "crashed":  # it died on this input
                worker = None
                self.restarts += 1
                return Verdict(0.0, f"verifier crashed: {reply[1]}")
        finally:
            self._idle.put(worker)
        status = reply[0]
        if status == "ok":
            return Verdict(float(reply[1]), str(reply[2]), tuple(StepVerdict(int(e), float(r)) for e, r in reply[3]))
        if status == "invalid":
            raise ValueError(str(reply[1]))
        return Verdict(0.0, f"verifier error: {reply[1]}")

    @staticmethod
    def _call(worker: _Worker, request: list, timeout_s: float) -> list | None:
        """The reply; None past the deadline and ["crashed", reason] when the worker died (either way it is killed)."""
        try:
            reply = worker.call(request, timeout_s)
        except (OSError, EOFError) as exc:
            worker.kill()
            return ["crashed", str(exc)]
        if reply is None:
            worker.kill()
        return reply

    async def score_async(self, verifier: str, response: str, task: Mapping[str, Any], timeout_s: float) -> Verdict:
        return await asyncio.to_thread(self.score, verifier, response, task, timeout_s)

    def close(self) -> None:
        for _ in range(self.size):
            try:
                worker = self._idle.get(timeout=0)
            except queue.Empty:
                break
            if worker is not None:
                worker.kill()


_shared: VerifierPool | None = None
_shared_lock = threading.Lock()


def shared_pool(workers: int = 2) -> VerifierPool:
    """One pool per process (its workers outlive any one Scorer)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = VerifierPool(workers)
        return _shared
