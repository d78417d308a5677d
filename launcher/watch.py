"""Follow a run on the EVENTS stream: record every event, draw the progress bar, stop at the run's end.

A service or NATS that dies meanwhile does not end the run: the stack's supervisor restarts it, the
connection here reconnects (to any server of a cluster) and the ordered consumer resumes where it was.
"""

from __future__ import annotations

import asyncio
import sys
import time

import nats
from nats.js.api import DeliverPolicy

from launcher.report import EventLog
from services.common.contracts import data_pb2


async def watch_run(stack, events: EventLog, *, total_steps: int, timeout: float, progress: bool = True) -> bool:
    """True when the builder published the run's end; False on timeout."""
    servers = [u for u in stack.nats.url.split(",") if u]

    async def quiet(*_args) -> None:  # disconnects while NATS restarts are expected; reconnects are automatic
        return None

    nc = await nats.connect(servers=servers, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                            error_cb=quiet, disconnected_cb=quiet)
    done = asyncio.Event()
    started = time.time()
    bar = ProgressBar(total_steps, enabled=progress)

    async def on_event(msg) -> None:
        event = data_pb2.VersionEvent.FromString(msg.data)
        events.add(event)
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


def _restarts(stack) -> int:
    return sum(getattr(stack, "restarts", {}).values())


class ProgressBar:
    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last_step = -1

    def update(self, events: EventLog, elapsed: float, *, restarts: int = 0) -> None:
        if not self.enabled:
            return
        step = events.version
        if not self.tty and step == self._last_step:
            return
        self._last_step = step
        width = 24
        filled = int(width * step / self.total) if self.total else 0
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total or '∞'} | policy v{events.deployed}"
                f" | reward {events.last_reward:.3f} | eval acc {events.last_accuracy_text} | staleness max "
                f"{events.max_staleness}{f' | restarts {restarts}' if restarts else ''} | {elapsed:5.0f}s")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)
