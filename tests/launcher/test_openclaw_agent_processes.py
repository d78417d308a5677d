"""The OpenClaw agent leaves no OpenClaw process behind: past its episode timeout, on SIGTERM, and when it is
SIGKILLed itself. A shell script stands in for the openclaw binary here (it records its pid and sleeps): what is
tested is the agent's process handling, not OpenClaw (tests/e2e/test_openclaw.py runs the real CLI)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.stack import ROOT

AGENTS = ROOT / "examples" / "agents"
sys.path.insert(0, str(AGENTS))
import openclaw_agent  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def fake_openclaw(tmp_path: Path) -> tuple[Path, Path]:
    pid_file = tmp_path / "pid"
    binary = tmp_path / "openclaw"
    binary.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 300\n")
    binary.chmod(0o755)
    return binary, pid_file


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_an_episode_past_its_timeout_is_killed_with_its_group(tmp_path):
    binary, pid_file = fake_openclaw(tmp_path)
    with pytest.raises(RuntimeError, match="did not finish the episode within 1s"):
        openclaw_agent.run_episode(binary, {}, "hi", "m", timeout=1)
    assert not alive(int(pid_file.read_text()))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_openclaw_dies_with_the_agent(tmp_path, sig):
    binary, pid_file = fake_openclaw(tmp_path)
    code = ("import sys, openclaw_agent; openclaw_agent._stop_on_sigterm(); "
            f"openclaw_agent.run_episode(__import__('pathlib').Path({str(binary)!r}), {{}}, 'hi', 'm', timeout=100)")
    agent = subprocess.Popen([sys.executable, "-c", code], cwd=AGENTS,
                             env={**os.environ, "PYTHONPATH": f"{AGENTS}{os.pathsep}{ROOT}"})
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text().strip()), "the fake openclaw never started"
        pid = int(pid_file.read_text())
        agent.send_signal(sig)
        assert agent.wait(timeout=20) != 0
        assert wait_for(lambda: not alive(pid)), f"openclaw (pid {pid}) outlived the agent's {sig.name}"
    finally:
        agent.kill()
        agent.wait(timeout=10)


def test_episodes_of_a_slot_run_in_the_same_emptied_folder_and_concurrent_ones_in_their_own():
    """OpenClaw's system prompt names the working directory: the same path again keeps it the same prompt (the
    engine's prefix cache then serves all of it), and nothing an earlier episode left is seen by the next."""
    slots = openclaw_agent.Slots(2)
    try:
        with slots.take() as first:
            (first / "left-behind").write_text("x")
            with slots.take() as second:
                assert second != first
        with slots.take() as again:
            assert again in (first, second) and not any(again.iterdir())
        with slots.take() as a, slots.take() as b:
            assert {a, b} == {first, second}
    finally:
        slots.close()
    assert not slots.root.exists()
