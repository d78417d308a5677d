"""The sandbox's interface: statuses, stdin, the CLI's JSON line, concurrency, and the start-up check that refuses
to run anything when bwrap cannot sandbox."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import pytest

from services.reward.sandbox import Limits, SandboxConfig, SandboxUnavailable

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def sandbox():
    try:
        return SandboxConfig(limits=Limits(timeout_s=3.0), concurrency=2).build()
    except SandboxUnavailable as exc:
        pytest.fail(f"{exc} -- the sandbox needs bubblewrap: scripts/install_bwrap.sh (run by make setup)")


@pytest.mark.parametrize("code,status,exit_code", [
    ("print(input()[::-1])", "ok", 0),
    ("raise ValueError('no')", "error", 1),
    ("import sys; sys.exit(3)", "error", 3),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "killed", -11),
    ("import resource, time\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\nwhile True: pass", "timeout", -24),
])
def test_statuses(sandbox, code, status, exit_code):
    result = sandbox.run(code, "olleh\n", timeout_s=30)  # 1 s of CPU can take many seconds on a loaded machine
    assert (result.status, result.exit_code) == (status, exit_code), result.stderr
    if status == "ok":
        assert result.stdout == "hello\n"


def test_runs_wait_for_a_free_slot(sandbox):
    async def four():
        return await asyncio.gather(*(sandbox.run_async("import time; time.sleep(0.6)") for _ in range(4)))

    start = time.monotonic()
    results = asyncio.run(four())
    assert all(r.status == "ok" for r in results)
    assert time.monotonic() - start >= 1.2  # two slots: two rounds


def test_the_cli_prints_one_json_line(tmp_path):
    program, stdin = tmp_path / "p.py", tmp_path / "in.txt"
    program.write_text("import time\nprint(input() * 2)\ntime.sleep(float(input()))\n")
    stdin.write_text("ab\n0\n")
    run = [sys.executable, "-m", "services.reward.sandbox", "run", str(program), "--stdin", str(stdin), "--timeout", "2"]
    out = json.loads(subprocess.run(run, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert out["status"] == "ok" and out["stdout"] == "abab\n" and out["exit_code"] == 0
    assert set(out) == {"status", "exit_code", "stdout", "stderr", "wall_seconds"}
    stdin.write_text("ab\n30\n")
    out = json.loads(subprocess.run(run, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert out["status"] == "timeout" and out["exit_code"] is None and out["wall_seconds"] < 4


@pytest.mark.parametrize("bwrap,message", [("no-such-bwrap", "not found on PATH: run scripts/install_bwrap.sh"),
                                           ("false", "cannot run `true` in a sandbox")])
def test_no_working_bwrap_is_a_clear_start_up_error(bwrap, message):
    with pytest.raises(SandboxUnavailable, match=message):
        SandboxConfig(bwrap=bwrap).build()


@pytest.mark.parametrize("kwargs,field", [({"concurrency": 0}, "concurrency"), ({"uid_base": 0}, "uid_base")])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**kwargs)
    with pytest.raises(ValueError, match="nproc"):
        Limits(nproc=1)
