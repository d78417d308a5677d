"""Signals and orphans: SIGTERM to `meshrl run` stops every process of the run within 30 s and exits 143; SIGKILL
of it still takes every child with it (PR_SET_PDEATHSIG), ports freed. Real processes: the launcher, nats-server and
the five services on the tiny model; the launcher runs in a session of its own, which every process it starts
(and theirs) stays in, so a scan of /proc by session finds whatever the run left behind."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
import yaml

from launcher.stack import ROOT, SERVICES, health_check
from launcher.supervisor import pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STARTUP_S = 150.0  # the five services importing torch and loading the model on a busy 2-core machine
STOP_S = 30.0


def session_pids(session: int) -> list[int]:
    """Live processes (zombies excluded) of a session, the session leader included."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def start_run(tmp_path: pathlib.Path) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    log = tmp_path / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", "--config", "configs/e2e.yaml",
                                 "--random-ports", "--runs-root", str(tmp_path), "--name", "sig"], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, tmp_path / "sig", log


def wait_serving(proc: subprocess.Popen, run_dir: pathlib.Path, log: pathlib.Path) -> list[int]:
    """Until the five services answer health checks (bounded); the run's ports (gRPC, NATS, gateway)."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        assert proc.poll() is None, f"the launcher exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not SERVING within {STARTUP_S}s:\n{log.read_text()[-3000:]}"
        files = [run_dir / "config" / f"{s}.yaml" for s in SERVICES]
        if all(f.exists() for f in files):
            configs = {s: yaml.safe_load(f.read_text()) for s, f in zip(SERVICES, files, strict=True)}
            if all(configs.values()) and all(health_check(c["grpc_address"]) for c in configs.values()):
                ports = [int(c["grpc_address"].rpartition(":")[2]) for c in configs.values()]
                ports += [urlparse(configs["rollout"]["nats_url"]).port, configs["rollout"]["gateway"]["port"]]
                return ports
        time.sleep(0.5)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of closed connections is no listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_gone(session: int, ports: list[int], deadline: float) -> tuple[list[int], list[int]]:
    """Until no process of the session is alive and every port binds, or the deadline: (pids left, ports held)."""
    while True:
        left = session_pids(session)
        held = [p for p in ports if not port_free(p)]
        if (not left and not held) or time.monotonic() > deadline:
            return left, held
        time.sleep(0.2)


def cleanup(session: int) -> None:
    for pid in session_pids(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {command}")
        except OSError:
            out.append(str(pid))
    return out


def test_sigterm_stops_every_process_of_the_run_within_30s_and_exits_143(tmp_path, tiny_qwen3):
    proc, run_dir, log = start_run(tmp_path)
    try:
        ports = wait_serving(proc, run_dir, log)
        children = [p for p in session_pids(proc.pid) if p != proc.pid]
        assert len(children) >= 6, describe(children)  # nats-server and the five services at least
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs {STOP_S}s after SIGTERM:\n{log.read_text()[-3000:]}")
        left, held = wait_gone(proc.pid, ports, signalled + STOP_S)
        assert not left, f"left running after SIGTERM: {describe(left)}"
        assert not held, f"ports still bound after SIGTERM: {held}"
        assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
        text = log.read_text()
        assert f"the run's results so far (summary.json, metrics.jsonl, logs/, checkpoints/) are in {run_dir}" in text
        summary = yaml.safe_load((run_dir / "summary.json").read_text())
        assert summary["interrupted"] == "SIGTERM" and not summary["completed"]
        assert not any(pid_alive(p) for p in children)
    finally:
        if proc.poll() is None:
            proc.kill()
        cleanup(proc.pid)


def test_sigkill_of_the_launcher_takes_every_child_with_it(tmp_path, tiny_qwen3):
    proc, run_dir, log = start_run(tmp_path)
    try:
        ports = wait_serving(proc, run_dir, log)
        children = [p for p in session_pids(proc.pid) if p != proc.pid]
        assert len(children) >= 6, describe(children)
        killed = time.monotonic()
        proc.kill()
        proc.wait(timeout=10)
        left, held = wait_gone(proc.pid, ports, killed + STOP_S)
        assert not left, f"left running after the launcher's SIGKILL: {describe(left)}"
        assert not held, f"ports still bound after the launcher's SIGKILL: {held}"
    finally:
        cleanup(proc.pid)
