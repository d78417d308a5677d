"""How `meshrl run`, `meshrl chaos` and the `make up` supervisor stop on SIGINT / SIGTERM.

The first signal raises `Interrupted` in the main thread, wherever it is (starting the stack, waiting for health,
following the run): the command's `finally` then stops what it started within `STOP_BUDGET_S` (the services get a
SIGTERM and a grace period, so the trainer can write a final checkpoint, then SIGKILL; NATS last), says where the
run's results are, and the command exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A signal that
arrives while that stop is already going does not interrupt it; a second signal ends everything at once
(SIGKILL to every child, `os._exit`). Children die with the launcher even when it is SIGKILLed:
`launcher.processes.popen`.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator

from launcher.processes import kill_children

STOP_BUDGET_S = 30.0        # from the first signal to the last child gone
SERVICE_GRACE_S = 18.0      # of it: the services' SIGTERM-to-SIGKILL grace (then trainer ranks, then NATS)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGINT or SIGTERM. A KeyboardInterrupt, so asyncio and `except Exception` pass it on."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(self.name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Shutdown:
    """The signal policy above, as state: `handler` is what `handling()` installs. `kill` and `exit` are what the
    second signal calls (tests pass their own)."""

    def __init__(self, *, kill: Callable[[], object] = kill_children,
                 exit: Callable[[int], object] = os._exit) -> None:
        self.kill = kill
        self.exit = exit
        self.received: int | None = None  # the first signal's number
        self.results = ""                 # where the run's results are, for the second signal's last word
        self._raised = False
        self._stopping = 0

    def handler(self, signum: int, _frame=None) -> None:
        if self.received is not None:  # the second signal: stop at once
            self.kill()
            where = f"; the run's results so far are in {self.results}" if self.results else ""
            _say(f"meshrl: second {signal.Signals(signum).name}: killed every process at once{where}")
            self.exit(128 + signum)
            return
        self.received = signum
        if self._stopping:  # a bounded stop is running already: let it finish, then exit non-zero
            _say(f"meshrl: {signal.Signals(signum).name}: stopping already (at most {STOP_BUDGET_S:g} s; "
                 "again to kill everything at once)")
            return
        self._raised = True
        _say(f"meshrl: {signal.Signals(signum).name}: stopping every process of the run (at most "
             f"{STOP_BUDGET_S:g} s; again to kill everything at once)")
        raise Interrupted(signum)

    @contextlib.contextmanager
    def handling(self) -> Iterator[Shutdown]:
        """Install the handler for SIGINT and SIGTERM (main thread only), restore the old ones after."""
        old = {sig: signal.signal(sig, self.handler) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, previous in old.items():
                signal.signal(sig, previous)

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """A stop in progress: a first signal now is noted, not raised; it is raised once the stop is done."""
        self._stopping += 1
        try:
            yield
        finally:
            self._stopping -= 1
        if self.received is not None and not self._raised and not self._stopping:
            self._raised = True
            raise Interrupted(self.received)

    @property
    def interrupted(self) -> bool:
        return self.received is not None

    def grace(self, normal: float) -> float:
        """The services' grace period: `normal` for a run that ended, SERVICE_GRACE_S after a signal."""
        return min(normal, SERVICE_GRACE_S) if self.interrupted else normal


def _say(line: str) -> None:
    """To stderr without Python's buffered writer (the main thread may be inside a print when a signal lands)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


SHUTDOWN = Shutdown()
