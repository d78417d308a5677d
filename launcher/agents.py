"""Drive example agents against the gateway for `make run-agent`: episodes until the run ends."""

from __future__ import annotations

import itertools
import os
import pathlib
import subprocess
import sys
import threading

ROOT = pathlib.Path(__file__).resolve().parent.parent


class AgentDriver:
    """Runs the configured agent scripts one after another, round robin, until stopped."""

    def __init__(self, scripts: list[str], args: list[str], *, gateway_url: str, log_path: pathlib.Path) -> None:
        self.scripts = [ROOT / "examples" / "agents" / s for s in scripts]
        self.args = [str(a) for a in args]
        self.gateway_url = gateway_url
        self.log_path = log_path
        self.episodes_run = 0
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._thread = threading.Thread(target=self._loop, name="agents", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        with open(self.log_path, "ab") as log:
            for seed, script in zip(itertools.count(), itertools.cycle(self.scripts)):
                if self._stop.is_set():
                    return
                self._proc = subprocess.Popen(
                    [sys.executable, str(script), "--base-url", self.gateway_url, "--seed", str(seed), *self.args],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
                self._proc.wait()
                self.episodes_run += 1

    def stop(self) -> None:
        self._stop.set()
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._thread.join(timeout=15)
