"""Drive example agents against the gateway for `make run-agent`: episodes until the run ends."""

from __future__ import annotations

import itertools
import os
import pathlib
import shlex
import subprocess
import sys
import threading
import time

from launcher.processes import popen, terminate_all

ROOT = pathlib.Path(__file__).resolve().parent.parent
AGENTS_DIR = ROOT / "examples" / "agents"


def agent_command(entry: str) -> tuple[pathlib.Path, list[str]]:
    """A run file's `agents` entry: a script in examples/agents, then that agent's own arguments
    ("code_agent.py --task functions"); ValueError when the script is not there."""
    script, *own = shlex.split(entry)
    path = AGENTS_DIR / script
    if pathlib.Path(script).name != script or not path.is_file():
        known = ", ".join(sorted(p.name for p in AGENTS_DIR.glob("*_agent.py")))
        raise ValueError(f"no agent script {script!r} in examples/agents (known: {known})")
    return path, own


def sent_temperature(args: list[str]) -> float | None:
    """The `--temperature` an agent's arguments give it (the last one wins, as in argparse), if any."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--temperature" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--temperature="):
            value = arg.partition("=")[2]
    try:
        return None if value is None else float(value)
    except ValueError:
        raise ValueError(f"--temperature: must be a number, got {value!r}") from None


def temperature_env(temperature: float) -> dict[str, str]:
    """What tells the agents the run's sampling temperature (examples/agents/common.py reads it as --temperature's
    default). At the API's default, 1.0, nothing: agents that cannot set a temperature still run then."""
    return {} if temperature == 1.0 else {"MESHRL_TEMPERATURE": repr(float(temperature))}


class AgentDriver:
    """Runs every configured agent script at once, each in a loop of fresh processes, until stopped."""

    def __init__(self, scripts: list[str], args: list[str], *, gateway_url: str, log_path: pathlib.Path,
                 env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}  # env: the frozen models' addresses
        self.commands = [agent_command(s) for s in scripts]
        self.args = [str(a) for a in args]
        self.gateway_url = gateway_url
        self.log_path = log_path
        self.episodes_run = 0
        self._stop = threading.Event()
        self._procs: dict[int, subprocess.Popen] = {}
        self._threads = [threading.Thread(target=self._loop, args=(i, *command), name=f"agent-{i}", daemon=True)
                         for i, command in enumerate(self.commands)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _loop(self, index: int, script: pathlib.Path, own: list[str]) -> None:
        with open(self.log_path, "ab") as log:
            for run in itertools.count():
                if self._stop.is_set():
                    return
                seed = run * len(self.commands) + index  # every process plays different tasks
                self._procs[index] = popen(
                    [sys.executable, str(script), "--base-url", self.gateway_url, "--seed", str(seed), *self.args,
                     *own],  # the agent's own arguments last: they win over the run's shared agent_args
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)
                self._procs[index].wait()
                self.episodes_run += 1

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the running episodes, SIGKILL what is left after `timeout` s (one deadline for all)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        terminate_all(list(self._procs.values()), timeout)
        for thread in self._threads:
            thread.join(timeout=max(0.1, deadline + 5 - time.monotonic()))
