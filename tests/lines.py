"""A child's stdout line under a deadline: a child that never prints what a test waits for fails the test in
seconds, naming what was awaited and how the child ended, instead of blocking in `readline()` until the suite's
guard."""

from __future__ import annotations

import queue
import subprocess
import threading


def read_line(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """The next line of `proc.stdout` within `timeout` seconds; AssertionError naming `what` past it or at EOF.
    The reading thread stays blocked until the child ends (the caller kills it)."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True, name="read-line").start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no line from pid {proc.pid} ({what}) within {timeout:g}s; "
                             f"exit code {proc.poll()}") from None
    if not line:
        raise AssertionError(f"pid {proc.pid} closed its stdout before {what}; exit code {proc.poll()}")
    return line
