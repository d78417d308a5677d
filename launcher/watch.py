"""Follow a run on the EVENTS stream: record every event, show progress (tqdm), stop at the run's end.

A service or NATS that dies meanwhile does not end the run: the stack's supervisor restarts it, the
connection here reconnects (to any server of a cluster) and the ordered consumer resumes where it was.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TextIO

import nats
from nats.js.api import DeliverPolicy
from tqdm import tqdm

from launcher.cpu import CPU_LOG
from launcher.report import EventLog
from services.common.contracts import data_pb2


async def watch_run(stack, events: EventLog, *, total_steps: int, timeout: float, progress: bool = True) -> bool:
    """True when the builder published the run's end; False on timeout."""
    servers = [u for u in stack.nats.url.split(",") if u]

    async def quiet(*_args) -> None:  # disconnects while NATS restarts are expected; reconnects are automatic
        return None

    credentials = getattr(stack, "nats_connect_options", None) or {}  # the operator's, on a launched stack
    nc = await nats.connect(servers=servers, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                            error_cb=quiet, disconnected_cb=quiet, **credentials)
    done = asyncio.Event()
    started = time.time()
    bar = ProgressBar(total_steps, enabled=progress)

    cpu_log = events.path.parent / CPU_LOG

    async def on_event(msg) -> None:
        event = data_pb2.VersionEvent.FromString(msg.data)
        events.add(event)
        if event.kind == data_pb2.VERSION_KIND_TRAINED:
            sample_cpu(stack, event.version, cpu_log)
        bar.update(events, time.time() - started, restarts=_restarts(stack))
        if event.kind == data_pb2.VERSION_KIND_RUN_END:
            done.set()

    while True:  # NATS (or the cluster's stream leader) may be restarting right now
        try:
            # the ordered consumer lives in one server's memory: after two missed heartbeats (a restarted
            # server) the client recreates it from the next stream sequence, so a short heartbeat resumes fast
            sub = await nc.jetstream().subscribe("events.>", cb=on_event, ordered_consumer=True,
                                                 deliver_policy=DeliverPolicy.ALL, idle_heartbeat=1.0)
            break
        except Exception:
            if time.time() - started > timeout:
                await nc.close()
                raise
            await asyncio.sleep(0.5)
    try:
        while not done.is_set():
            if time.time() - started > timeout:
                print(f"\nrun did not finish within {timeout}s", file=sys.stderr)
                return False
            try:
                await asyncio.wait_for(done.wait(), timeout=1.0)
            except TimeoutError:
                bar.update(events, time.time() - started, restarts=_restarts(stack))
        return True
    finally:
        bar.close()
        try:
            await sub.unsubscribe()
        except Exception:  # NATS may be down at this moment; the connection goes anyway
            pass
        await nc.close()


def sample_cpu(stack, version: int, path) -> None:
    """One line of CPU-seconds so far per process (cumulative, children included) at a trained step: what each
    step cost each process is the difference of two lines (launcher.cpu.per_step)."""
    cpu = stack.cpu_seconds() if hasattr(stack, "cpu_seconds") else None  # a remote stack's are not ours to read
    if cpu:
        with open(path, "a") as f:
            f.write(json.dumps({"version": version, "at": time.time(), "cpu": cpu}) + "\n")


def _restarts(stack) -> int:
    return sum(getattr(stack, "restarts", {}).values())


class ProgressBar:
    """tqdm on a terminal; elsewhere (a log file, CI) one plain line each time the step changes."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self._last_step = -1
        self._bar = None
        if enabled and self.stream.isatty():
            self._bar = tqdm(total=total or None, file=self.stream, unit="step", dynamic_ncols=True)

    def update(self, events: EventLog, elapsed: float, *, restarts: int = 0) -> None:
        if not self.enabled:
            return
        step = events.version
        status = (f"policy v{events.deployed} | reward {events.last_reward:.3f} | eval acc {events.last_accuracy_text}"
                  f" | staleness max {events.max_staleness}{f' | restarts {restarts}' if restarts else ''}"
                  f"{f' | warning: {events.accuracy_warning}' if events.accuracy_warning else ''}")
        if self._bar is not None:
            self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(step - self._bar.n)  # events.version only grows
            self._bar.refresh()
        elif step != self._last_step:
            self._last_step = step
            print(f"step {step}/{self.total or '?'} | {status} | {elapsed:.0f}s", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
