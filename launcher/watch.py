"""Follow a run on the EVENTS stream: record every event, draw the progress bar, stop at the run's end."""

from __future__ import annotations

import asyncio
import sys
import time

import nats
from nats.js.api import DeliverPolicy

from launcher.report import EventLog
from services.common.contracts import data_pb2


async def watch_run(stack, events: EventLog, *, total_steps: int, timeout: float, progress: bool = True) -> bool:
    """True when the builder published the run's end; False on timeout or when a service died."""
    nc = await nats.connect(stack.nats.url)
    done = asyncio.Event()
    started = time.time()
    bar = ProgressBar(total_steps, enabled=progress)

    async def on_event(msg) -> None:
        event = data_pb2.VersionEvent.FromString(msg.data)
        events.add(event)
        bar.update(events, time.time() - started)
        if event.kind == data_pb2.VERSION_KIND_RUN_END:
            done.set()

    sub = await nc.jetstream().subscribe("events.>", cb=on_event, ordered_consumer=True,
                                         deliver_policy=DeliverPolicy.ALL)
    try:
        while not done.is_set():
            dead = [s for s, p in stack.procs.items() if p.poll() is not None]
            if dead:
                print(f"\nservice(s) exited early: {dead}; logs in {stack.run_dir}/logs", file=sys.stderr)
                return False
            if time.time() - started > timeout:
                print(f"\nrun did not finish within {timeout}s", file=sys.stderr)
                return False
            try:
                await asyncio.wait_for(done.wait(), timeout=1.0)
            except TimeoutError:
                bar.update(events, time.time() - started)
        return True
    finally:
        bar.close()
        await sub.unsubscribe()
        await nc.close()


class ProgressBar:
    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last_step = -1

    def update(self, events: EventLog, elapsed: float) -> None:
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
                f"{events.max_staleness} | {elapsed:5.0f}s")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)
