"""The restart policy (pure, with a fake clock) and the supervisor with real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from launcher.supervisor import Backoff, RestartTracker, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_backoff_doubles_from_half_a_second_to_a_ten_second_cap():
    policy = Backoff()
    assert [policy.delay(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert policy.delay(10_000) == 10.0


@pytest.mark.parametrize("kwargs, field", [({"initial": 0}, "initial"), ({"factor": 0.5}, "factor"),
                                           ({"initial": 2, "cap": 1}, "cap"), ({"reset_after": -1}, "reset_after")])
def test_backoff_rejects_bad_settings_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Backoff(**kwargs)


def test_tracker_backs_off_on_quick_failures_and_resets_after_staying_up():
    tracker = RestartTracker(Backoff(initial=0.5, factor=2, cap=10, reset_after=60))
    tracker.started(0.0)
    assert tracker.exited(1.0) == 0.5 and tracker.restart_at == 1.5
    assert not tracker.due(1.4) and tracker.due(1.5)
    tracker.started(1.5)
    assert tracker.exited(2.0) == 1.0
    tracker.started(3.0)
    assert tracker.exited(3.1) == 2.0
    assert tracker.failures == 3
    tracker.started(5.1)
    assert tracker.exited(5.1 + 59.9) == 4.0, "up for less than reset_after: still a quick failure"
    tracker.started(100.0)
    assert tracker.exited(160.0) == 0.5, "up for reset_after: back to the first delay"
    assert tracker.failures == 1


class FakeProc:
    """What the supervisor reads of a Popen: pid, poll(), returncode, send_signal()."""

    pids = iter(range(1000, 2000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.returncode = -sig


def test_supervisor_poll_restarts_after_the_back_off_with_a_fake_clock(tmp_path):
    now = [0.0]
    spawned: list[FakeProc] = []

    def spawn() -> FakeProc:
        spawned.append(FakeProc())
        return spawned[-1]

    sup = Supervisor(Backoff(), log_path=tmp_path / "supervisor.log", echo=False, clock=lambda: now[0])
    sup.add("reward", spawn)
    first = sup.pid("reward")
    now[0] = 5.0
    spawned[-1].returncode = 1
    sup.poll()  # noticed: restart in 0.5 s
    assert sup.pid("reward") is None and sup.restarts == {"reward": 0}
    now[0] = 5.4
    sup.poll()
    assert len(spawned) == 1
    now[0] = 5.5
    sup.poll()
    assert len(spawned) == 2 and sup.restarts == {"reward": 1} and sup.pid("reward") not in (None, first)
    assert sup.kill("reward", signal.SIGKILL) == spawned[-1].pid
    now[0] = 6.0
    sup.poll()  # a second quick failure: 1 s
    now[0] = 6.9
    sup.poll()
    assert len(spawned) == 2
    now[0] = 7.0
    sup.poll()
    assert len(spawned) == 3 and sup.failures("reward") == 2
    records = [json.loads(line) for line in (tmp_path / "supervisor.log").read_text().splitlines()]
    assert [(r["service"], r["exit_code"], r["restart_in"]) for r in records] == [("reward", 1, 0.5),
                                                                                 ("reward", -9, 1.0)]
    assert all(isinstance(r["at"], float) for r in records)
    sup.stop()
    spawned[-1].returncode = 0
    now[0] = 100.0
    sup.poll()
    assert len(spawned) == 3, "no restart once supervision stopped"
    with pytest.raises(ValueError, match="name"):
        sup.pid("nope")


def _wait(predicate, timeout: float, step: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(step)


def test_supervisor_restarts_a_sigkilled_process_after_its_back_off(tmp_path):
    procs: list[subprocess.Popen] = []

    def spawn() -> subprocess.Popen:
        procs.append(subprocess.Popen(SLEEPER))
        return procs[-1]

    log = tmp_path / "supervisor.log"
    sup = Supervisor(Backoff(initial=0.5, factor=2, cap=10, reset_after=60), log_path=log, echo=False,
                     poll_interval=0.02)
    sup.add("dummy", spawn)
    sup.start()
    try:
        old = sup.pid("dummy")
        killed_at = time.monotonic()
        assert sup.kill("dummy") == old
        _wait(lambda: sup.restarts["dummy"] == 1, 5)
        first_restart = time.monotonic() - killed_at
        new = sup.pid("dummy")
        assert new is not None and new != old
        assert procs[0].returncode == -signal.SIGKILL
        assert 0.5 <= first_restart < 1.5, first_restart

        killed_at = time.monotonic()  # again, before it stayed up 60 s: the delay doubles
        sup.kill("dummy")
        _wait(lambda: sup.restarts["dummy"] == 2, 5)
        second_restart = time.monotonic() - killed_at
        assert 1.0 <= second_restart < 2.0, second_restart
        assert sup.pid("dummy") not in (None, old, new)

        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert [(r["service"], r["exit_code"], r["restart_in"]) for r in records] == [("dummy", -9, 0.5),
                                                                                     ("dummy", -9, 1.0)]
        assert {"service", "at", "exit_code", "restart_in"} <= set(records[0])
    finally:
        sup.stop()
        last = procs[-1]
        last.kill()
        last.wait()
    sup.kill("dummy")  # already dead: nothing to signal, and no restart once stopped
    time.sleep(0.7)
    assert sup.restarts["dummy"] == 2 and len(procs) == 3


def test_supervisor_backs_off_a_crash_loop_and_stop_is_not_fought(tmp_path):
    procs: list[subprocess.Popen] = []

    def spawn() -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
        return procs[-1]

    log = tmp_path / "supervisor.log"
    sup = Supervisor(Backoff(initial=0.2, factor=2, cap=0.5, reset_after=60), log_path=log, echo=False,
                     poll_interval=0.02)
    sup.add("crashy", spawn)
    sup.start()
    try:
        _wait(lambda: len(log.read_text().splitlines()) >= 4 if log.exists() else False, 20, step=0.05)
    finally:
        sup.stop()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["restart_in"] for r in records[:4]] == [0.2, 0.4, 0.5, 0.5]
    assert all(r["exit_code"] == 3 for r in records)
    count = len(procs)
    time.sleep(0.8)
    assert len(procs) == count, "stopped supervision starts nothing"
    for proc in procs:
        proc.wait(timeout=10)
