"""F13: two builders and two weight exchanges at once, as real processes on one nats-server: exactly one of each
serves, the other waits as a standby; SIGKILL the active one and the standby takes over (at once here: the dead
holder is a process of this host; from another host after the lease's TTL, tests/common/test_lease.py); a clean
SIGTERM hands over at once."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.marks import full

ROOT = pathlib.Path(__file__).resolve().parents[2]
LEASE = 4.0


class Service:
    """A service process whose JSON log lines are collected as they come."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", f"services.{name}"], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.events: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.append(json.loads(line).get("event", ""))
            except ValueError:
                pass

    def wait_for(self, event: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if event in self.events:
                return True
            if self.proc.poll() is not None:
                return event in self.events
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def env_for(service: str, nats_url: str, run_dir: pathlib.Path, **extra: str) -> dict[str, str]:
    prefix = f"MESHRL_{service.upper()}__"
    values = {"NATS_URL": nats_url, "GRPC_ADDRESS": "127.0.0.1:0", "METRICS_PORT": "-1", "RUN_DIR": str(run_dir),
              "LEASE_SECONDS": str(LEASE), "NATS_MAX_BYTES": "-1", **extra}
    return {**os.environ, **{prefix + k: v for k, v in values.items()}}


@pytest.mark.parametrize("service", ["builder", full("weight_exchange")])  # the same lease code: one in make test
def test_a_second_instance_stands_by_and_takes_over_when_the_active_one_dies(service, nats_server, tmp_path,
                                                                              tiny_qwen3):
    extra = {"MODEL_PATH": str(tiny_qwen3)} if service == "builder" else {}
    env = env_for(service, nats_server.url, tmp_path, **extra)
    first = Service(service, env)
    procs = [first]
    try:
        assert first.wait_for("serving", 120), first.events[-20:]
        second = Service(service, env)
        procs.append(second)
        assert second.wait_for("lease_standby", 60), second.events[-20:]
        time.sleep(2 * LEASE)  # the active one renews: the standby never serves meanwhile
        assert "serving" not in second.events and first.proc.poll() is None
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)  # reaped, as a supervisor does
        assert second.wait_for("serving", 60), second.events[-20:]
        assert "lease_abandoned" in second.events
        # a clean stop releases the lease: a third instance takes over at once
        third = Service(service, env)
        procs.append(third)
        assert third.wait_for("lease_standby", 60), third.events[-20:]
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(30) == 0
        t0 = time.monotonic()
        assert third.wait_for("serving", 60), third.events[-20:]
        assert time.monotonic() - t0 < LEASE, "released at a clean stop: no wait for the lease to lapse"
    finally:
        for p in procs:
            p.stop()
