"""Restart what dies, like Compose's `restart: unless-stopped`: a pure back-off policy and a supervisor of processes.

`Backoff` and `RestartTracker` hold the policy with no I/O (tests drive them with their own clock). `Supervisor`
applies it to child processes: each child is a name and a `spawn()` that starts it again with the same command
line (config file, ports, log file); a poll notices an exit, logs one JSON line {service, at, exit_code,
restart_in} to stderr and to the supervisor log, and spawns the child again once its back-off has passed.
`stop()` ends supervision first, so a final SIGTERM of everything is never fought.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from services.common.errors import FieldError


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Restart delays: `initial` s, times `factor` per quick failure in a row, at most `cap` s.

    A child that stayed up `reset_after` s or longer before it died counts as healthy: its next delay is `initial`.
    """

    initial: float = 0.5
    factor: float = 2.0
    cap: float = 10.0
    reset_after: float = 60.0

    def __post_init__(self) -> None:
        if not self.initial > 0:
            raise FieldError("initial", f"must be > 0, got {self.initial}")
        if not self.factor >= 1:
            raise FieldError("factor", f"must be >= 1, got {self.factor}")
        if not self.cap >= self.initial:
            raise FieldError("cap", f"must be >= initial ({self.initial}), got {self.cap}")
        if not self.reset_after >= 0:
            raise FieldError("reset_after", f"must be >= 0, got {self.reset_after}")

    def delay(self, failures: int) -> float:
        """The wait before the restart that follows `failures` earlier quick failures in a row (0 for the first)."""
        if failures < 0:
            raise FieldError("failures", f"must be >= 0, got {failures}")
        if failures >= 64:  # factor ** failures would overflow long after the cap was reached
            return self.cap
        return min(self.cap, self.initial * self.factor**failures)


@dataclasses.dataclass
class RestartTracker:
    """One child's restart state (pure: every method takes the time `now`, any monotonic clock)."""

    policy: Backoff = dataclasses.field(default_factory=Backoff)
    failures: int = 0  # quick failures in a row (the child died before `reset_after`)
    restarts: int = 0  # times the child was started again
    started_at: float | None = None
    restart_at: float | None = None  # when the child is due to be started again; None while it runs

    def started(self, now: float) -> None:
        """The child was (re)started at `now`."""
        self.started_at = now
        self.restart_at = None

    def exited(self, now: float) -> float:
        """The child died at `now`: the delay before its restart (also stored as `restart_at`)."""
        if self.started_at is not None and now - self.started_at >= self.policy.reset_after:
            self.failures = 0
        delay = self.policy.delay(self.failures)
        self.failures += 1
        self.started_at = None
        self.restart_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at


@dataclasses.dataclass
class Child:
    name: str
    spawn: Callable[[], subprocess.Popen]
    tracker: RestartTracker
    proc: subprocess.Popen | None = None
    hold_until: float = 0.0  # no restart before this time (an outage kept on purpose)


class Supervisor:
    """Keeps named child processes running: restarts each one that exits, with `Backoff` between tries.

    `poll()` does one pass (tests call it directly); `start()` runs passes on a daemon thread every
    `poll_interval` s until `stop()`. Exits are logged as JSON lines to stderr and to `log_path` (appended).
    """

    def __init__(self, policy: Backoff | None = None, *, log_path: pathlib.Path | None = None, echo: bool = True,
                 poll_interval: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy or Backoff()
        self.log_path = log_path
        self.echo = echo
        self.poll_interval = poll_interval
        self.clock = clock
        self._children: dict[str, Child] = {}
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    # children

    def add(self, name: str, spawn: Callable[[], subprocess.Popen], *, proc: subprocess.Popen | None = None
            ) -> subprocess.Popen:
        """Supervise `name`: adopt `proc` when given (already started by `spawn`), else spawn it now."""
        with self._lock:
            if name in self._children:
                raise FieldError("name", f"{name!r} is supervised already")
            child = Child(name, spawn, RestartTracker(self.policy))
            child.proc = proc if proc is not None else spawn()
            child.tracker.started(self.clock())
            self._children[name] = child
            return child.proc

    @property
    def names(self) -> list[str]:
        return list(self._children)

    def proc(self, name: str) -> subprocess.Popen | None:
        """The child's current process (the dead one while it waits for its restart)."""
        return self._child(name).proc

    def pid(self, name: str) -> int | None:
        """The pid of the child's running process; None while it is down."""
        proc = self._child(name).proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def alive(self, name: str) -> bool:
        return self.pid(name) is not None

    def failures(self, name: str) -> int:
        """Quick failures in a row (a crash loop shows as a growing number)."""
        return self._child(name).tracker.failures

    @property
    def restarts(self) -> dict[str, int]:
        with self._lock:
            return {name: child.tracker.restarts for name, child in self._children.items()}

    def kill(self, name: str, sig: int = signal.SIGKILL, *, hold: float = 0.0) -> int | None:
        """Send `sig` to the child's running process; the supervisor restarts it (not before `hold` s have
        passed: an outage on purpose). The pid signalled, or None."""
        with self._lock:
            child = self._child(name)
            proc = child.proc
            if proc is None or proc.poll() is not None:
                return None
            child.hold_until = self.clock() + hold
            proc.send_signal(sig)
            return proc.pid

    def _child(self, name: str) -> Child:
        try:
            return self._children[name]
        except KeyError:
            raise FieldError("name", f"unknown {name!r} (supervised: {', '.join(self._children) or 'none'})") from None

    # supervision

    @property
    def supervising(self) -> bool:
        return not self._stopped.is_set()

    def poll(self) -> None:
        """One pass: notice exits (log them, schedule restarts) and start the children whose back-off has passed."""
        with self._lock:
            for child in self._children.values():
                if self._stopped.is_set():
                    return
                now = self.clock()
                tracker = child.tracker
                if tracker.restart_at is None:
                    if child.proc is None or child.proc.poll() is None:
                        continue
                    delay = tracker.exited(now)
                    self._log({"service": child.name, "at": round(time.time(), 3),
                               "exit_code": child.proc.returncode, "restart_in": round(delay, 3),
                               "pid": child.proc.pid, "restarts": tracker.restarts})
                if tracker.due(now) and now >= child.hold_until:
                    try:
                        child.proc = child.spawn()
                    except Exception as exc:  # e.g. the binary vanished: try again after the next back-off
                        delay = tracker.exited(now)
                        self._log({"service": child.name, "at": round(time.time(), 3), "exit_code": None,
                                   "restart_in": round(delay, 3), "error": f"spawn failed: {exc!r}",
                                   "restarts": tracker.restarts})
                        continue
                    tracker.restarts += 1
                    tracker.started(self.clock())

    def start(self) -> None:
        """Supervise on a daemon thread until `stop()`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_interval):
            try:
                self.poll()
            except Exception as exc:  # never let one bad pass end supervision
                self._log({"service": "supervisor", "at": round(time.time(), 3), "error": repr(exc)})

    def stop(self) -> None:
        """Stop supervising (no restart from now on, pending ones are dropped); the children keep running."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        with self._lock:  # a pass in progress on another thread (no start()) ends before this returns
            pass

    def _log(self, record: dict) -> None:
        line = json.dumps(record)
        if self.echo:
            prefix = "\r\033[K" if sys.stderr.isatty() else ""  # over a progress bar drawn with \r
            print(prefix + line, file=sys.stderr, flush=True)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(line + "\n")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (a zombie, dead but not reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no procfs (macOS): trust kill(0)
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"
