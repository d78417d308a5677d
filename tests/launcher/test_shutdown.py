"""The launcher's signal policy (launcher.shutdown) and its children's lifetime (launcher.processes.popen), with
real processes: a child dies with its launcher even when the launcher is SIGKILLed, also one a short-lived
thread started (and it outlives that thread); the race where the launcher died before prctl; a bounded stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launcher.processes import _die_with_parent, popen
from launcher.runconfig import RunConfig
from launcher.shutdown import SERVICE_GRACE_S, Interrupted, Shutdown
from launcher.stack import ROOT, SERVICES, Stack, random_ports
from launcher.supervisor import Backoff, Supervisor, pid_alive

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# ignores SIGTERM, then says so by creating the file it is given
STUBBORN = [sys.executable, "-c", "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)"]


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


# the policy, with fake kill and exit

def test_first_signal_raises_interrupted_and_a_second_kills_everything_at_once():
    calls = []
    shutdown = Shutdown(kill=lambda: calls.append("kill"), exit=lambda code: calls.append(code))
    with pytest.raises(Interrupted) as caught:
        shutdown.handler(signal.SIGTERM)
    assert caught.value.exit_code == 143 and caught.value.name == "SIGTERM" and calls == []
    assert shutdown.grace(30.0) == SERVICE_GRACE_S < 30.0
    shutdown.handler(signal.SIGINT)  # the second: at once
    assert calls == ["kill", 130]


def test_a_signal_during_the_stop_does_not_cut_it_short_and_is_raised_after_it():
    shutdown = Shutdown(kill=lambda: None, exit=lambda code: None)
    steps = []
    with pytest.raises(Interrupted) as caught:
        with shutdown.stopping():
            shutdown.handler(signal.SIGINT)  # noted, not raised: the stop goes on
            steps.append("stopped")
    assert steps == ["stopped"] and caught.value.exit_code == 130


def test_no_signal_no_interruption():
    shutdown = Shutdown(kill=lambda: None, exit=lambda code: None)
    with shutdown.stopping():
        pass
    assert not shutdown.interrupted and shutdown.grace(30.0) == 30.0


def test_handling_installs_the_handler_and_restores_the_old_one():
    before = signal.getsignal(signal.SIGTERM)
    shutdown = Shutdown(kill=lambda: None, exit=lambda code: None)
    with shutdown.handling():
        assert signal.getsignal(signal.SIGTERM) == shutdown.handler
        with pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here, in the main thread
    assert signal.getsignal(signal.SIGTERM) == before


# children and their launcher

PARENT = """
import threading, time
from launcher.processes import popen
main = popen({sleeper!r})
holder = []
thread = threading.Thread(target=lambda: holder.append(popen({sleeper!r})))
thread.start(); thread.join()  # the thread that asked for it has ended
print(main.pid, holder[0].pid, flush=True)
time.sleep(120)
"""


@linux
def test_children_die_with_a_sigkilled_launcher_also_those_a_finished_thread_asked_for():
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(sleeper=SLEEPER)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(1.0)
        assert all(pid_alive(p) for p in pids), "a child outlives the thread that asked for it"
        parent.kill()
        parent.wait(timeout=10)
        _wait(lambda: not any(pid_alive(p) for p in pids), 10)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in pids if "pids" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@linux
def test_a_child_whose_launcher_died_before_prctl_ends_itself():
    wrong_parent = os.getpid() + 1 if os.getppid() != os.getpid() + 1 else os.getpid() + 2
    proc = subprocess.Popen(SLEEPER, preexec_fn=lambda: _die_with_parent(wrong_parent))
    assert proc.wait(timeout=10) == -signal.SIGKILL


@linux
def test_a_child_the_supervisor_restarted_outlives_the_end_of_supervision(tmp_path):
    supervisor = Supervisor(Backoff(initial=0.1, cap=0.2), log_path=tmp_path / "supervisor.log", echo=False)
    supervisor.add("sleeper", lambda: popen(SLEEPER))
    supervisor.start()
    try:
        supervisor.kill("sleeper")
        _wait(lambda: supervisor.restarts["sleeper"] == 1 and supervisor.alive("sleeper"), 10)
        restarted = supervisor.proc("sleeper")  # started from the supervisor's thread
        supervisor.stop()  # that thread ends
        time.sleep(1.0)
        assert restarted.poll() is None, "killed when the supervisor's thread ended, before its graceful SIGTERM"
    finally:
        supervisor.proc("sleeper").kill()
        supervisor.proc("sleeper").wait(timeout=10)


def test_stack_stop_gives_the_services_one_grace_period_together_then_sigkills(tmp_path):
    stack = Stack(tmp_path / "run", random_ports(), policy=Backoff(initial=0.2, cap=1.0))
    stack._spawner = lambda service, config_file, *, detach: lambda: popen([*STUBBORN, str(tmp_path / service)])
    plan = RunConfig.from_dict({"services": {"builder": {"total_steps": 3}, "trainer": {"algo": "grpo"}}})
    stack.start(stack.derive(plan, seed=0, model_path=tmp_path / "model").files())
    _wait(lambda: all((tmp_path / s).exists() for s in SERVICES), 60)
    started = time.monotonic()
    codes = stack.stop(grace=2.0)
    elapsed = time.monotonic() - started
    assert codes == {s: -signal.SIGKILL for s in SERVICES}
    assert elapsed < 2.0 + 5.0, f"{elapsed:.1f}s: each service waited its own grace ({len(SERVICES)} x 2 s)"
