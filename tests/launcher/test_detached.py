"""`make up`'s detached supervisor process and `make down`: restarts recorded in the state file, down stops the
supervisor first and then nothing is left (dummy processes stand in for the five services)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

import launcher.stack as stack_module
from launcher.runconfig import RunConfig
from launcher.stack import ROOT, SERVICES, Stack, random_ports, read_state, write_state
from launcher.supervisor import pid_alive

# the supervise command with a dummy in place of `python -m services.<name>`
FAKE_SUPERVISE = """
import pathlib, sys
import launcher.stack as st
from launcher.processes import popen

def spawner(self, service, config_file, *, detach):
    return lambda: popen([sys.executable, "-c", "import time; time.sleep(120)"], detach=detach)

st.Stack._spawner = spawner
sys.exit(st.supervise(pathlib.Path(sys.argv[1])))
"""


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


def _start_supervisor(tmp_path, nats_mode: str = "single") -> tuple[subprocess.Popen, pathlib.Path]:
    state_file = tmp_path / ".stack" / "state.json"
    ports, run_dir = random_ports(), tmp_path / "run"
    plan = Stack(run_dir, ports, nats_mode=nats_mode).derive(RunConfig.from_dict({}), seed=0,
                                                             model_path=tmp_path / "model", detach=True)
    spec = {"configs": plan.files(), "nats_mode": nats_mode, "ports": ports, "run_dir": str(run_dir)}
    write_state(state_file, {"status": "starting", "spec": spec})
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SUPERVISE, str(state_file)], cwd=ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    threading.Thread(target=proc.wait, daemon=True).start()  # reap it as init would once `make up` returned
    _wait(lambda: read_state(state_file).get("status") == "running", 20)
    return proc, state_file


def test_detached_supervisor_restarts_records_and_down_stops_it_first(tmp_path, monkeypatch, capsys):
    proc, state_file = _start_supervisor(tmp_path)
    monkeypatch.setattr(stack_module, "STATE_FILE", state_file)
    try:
        state = read_state(state_file)
        assert state["supervisor_pid"] == proc.pid and set(state["pids"]) == set(SERVICES)
        nats_pid = state["nats_pids"]["nats"]
        old = state["pids"]["reward"]
        os.kill(old, signal.SIGKILL)
        _wait(lambda: read_state(state_file).get("restarts", {}).get("reward") == 1, 10)
        state = read_state(state_file)
        new = state["pids"]["reward"]
        assert new and new != old and pid_alive(new)
        pids = [*state["pids"].values(), nats_pid]
        stack_module.status()
        shown = capsys.readouterr().out
        assert "restarts 1" in shown and "supervisor" in shown and "RUNNING" in shown
        stack_module.down(grace=5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not state_file.exists()
    _wait(lambda: proc.poll() is not None, 5)
    assert proc.returncode == 128 + signal.SIGTERM, "the supervisor stopped everything on SIGTERM, then exited 143"
    assert not any(pid_alive(p) for p in pids)
    log = (tmp_path / "run" / "logs" / "supervisor.log").read_text()
    assert '"service": "reward"' in log


def test_a_killed_supervisors_processes_die_with_it_and_down_cleans_up(tmp_path, monkeypatch):
    proc, state_file = _start_supervisor(tmp_path)
    monkeypatch.setattr(stack_module, "STATE_FILE", state_file)
    state = read_state(state_file)
    pids = [*state["pids"].values(), *state["nats_pids"].values()]
    os.kill(proc.pid, signal.SIGKILL)
    _wait(lambda: proc.poll() is not None, 5)
    _wait(lambda: not any(pid_alive(p) for p in pids), 10)  # PR_SET_PDEATHSIG: nothing is left to orphan
    stack_module.down(grace=5)
    assert not state_file.exists()


def test_sigint_to_the_supervisor_stops_everything_and_exits_130(tmp_path):
    proc, state_file = _start_supervisor(tmp_path)
    state = read_state(state_file)
    pids = [*state["pids"].values(), *state["nats_pids"].values()]
    proc.send_signal(signal.SIGINT)
    _wait(lambda: proc.poll() is not None, 30)
    assert proc.returncode == 128 + signal.SIGINT
    assert not state_file.exists() and not any(pid_alive(p) for p in pids)


def test_down_without_a_stack(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(stack_module, "STATE_FILE", tmp_path / "state.json")
    stack_module.down()
    assert "no stack is up" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["mesh"])
def test_up_rejects_an_unknown_nats_mode(mode):
    with pytest.raises(SystemExit, match="--nats"):
        stack_module.up("configs/run.yaml", nats_mode=mode)
