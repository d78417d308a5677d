"""What bounds a run's processes together (review F10): SysV shared memory (outside RLIMIT_AS) and memory spread over
forked processes stop at the run's cgroup memory bound; and a non-root service, whose own threads share the uid
the sandbox runs as, still runs programs (RLIMIT_NPROC counted in the run's own user namespace), or says why not."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import pathlib
import pwd
import subprocess
import textwrap

import pytest

from services.reward.sandbox import Limits, SandboxConfig, SandboxUnavailable
from services.reward.sandbox.cgroup import Slot

ROOT = pathlib.Path(__file__).resolve().parents[3]
LIMITS = Limits(timeout_s=5.0, memory_mb=64, tmp_mb=16, nproc=32)  # the run's bound: 64 + 16 + 32 = 112 MiB
SYSTEM_PYTHON = "/usr/bin/python3"  # the project's venv may be unreadable to other uids; the sandbox needs stdlib only

SYSV_SHM = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
held = 0
for _ in range(6):
    sid = libc.shmget(0, 32 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    addr = libc.shmat(sid, None, 0)
    libc.memset(addr, 1, 32 << 20)  # the pages now exist, and stay after shmdt
    libc.shmdt(addr)
    held += 32
    print("held", held, flush=True)
'''

FORK_AND_ALLOCATE = r'''
import os, time
children = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        x = b"\1" * (24 << 20)  # touched: 24 MiB resident, well under each process's RLIMIT_AS
        time.sleep(3)
        os._exit(0)
    children.append(pid)
time.sleep(1.5)
alive = sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children)
print("alive", alive, flush=True)
'''


@pytest.fixture(scope="module")
def sandbox():
    try:
        box = SandboxConfig(limits=LIMITS, concurrency=1).build()
    except SandboxUnavailable as exc:
        pytest.fail(f"{exc} -- the escape suite needs bubblewrap: scripts/install_bwrap.sh (run by make setup)")
    if box.cgroups is None:
        pytest.skip(f"no per-run cgroup can be made here (needs root, or a delegated cgroup v2): {box.aggregate_bound}")
    yield box
    box.close()


def test_sysv_shared_memory_stops_at_the_run_memory_bound(sandbox):
    result = sandbox.run(SYSV_SHM)
    held = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("held")]
    assert result.status == "memory", (result.status, result.stdout, result.stderr[-500:])
    assert max(held, default=0) <= LIMITS.run_memory_bytes() >> 20, held  # not 192 MiB
    assert "memory bound (112 MiB" in result.cause and result.stderr.rstrip().endswith(result.cause)
    assert sandbox.run("print(1)").stdout == "1\n"  # the slot is usable again


def test_memory_spread_over_forked_processes_is_bounded_together(sandbox):
    result = sandbox.run(FORK_AND_ALLOCATE)
    assert result.status == "memory", (result.status, result.stdout, result.stderr[-500:])
    alive = int(result.stdout.split()[1])
    assert alive * 24 <= LIMITS.run_memory_bytes() >> 20, alive  # not 8 x 24 = 192 MiB at once


def test_the_slots_cgroups_go_with_the_sandbox():
    box = SandboxConfig(limits=LIMITS, concurrency=2).build()
    if box.cgroups is None:
        pytest.skip(f"no per-run cgroup here: {box.aggregate_bound}")
    dirs = [d for slot in box.cgroups.slots for d in slot.dirs]
    assert all(os.path.isdir(d) for d in dirs) and box.aggregate_bound.startswith("cgroup ")
    box.close()
    assert not any(os.path.exists(d) for d in dirs)


def test_without_a_cgroup_the_sandbox_says_what_is_unbounded(caplog):
    with caplog.at_level(logging.WARNING, logger="services.reward.sandbox.pool"):
        box = SandboxConfig(limits=LIMITS, cgroup="off").build()
    assert box.cgroups is None and box.aggregate_bound.startswith("none (SandboxConfig.cgroup is 'off')")
    assert "SysV shared memory" in box.aggregate_bound
    assert [r.getMessage() for r in caplog.records] == [f"sandbox: no aggregate memory/pids bound per run: "
                                                        f"{box.aggregate_bound}"]
    assert box.run("print(1)").stdout == "1\n"


def test_a_bad_cgroup_setting_names_the_field():
    with pytest.raises(ValueError, match="cgroup"):
        SandboxConfig(cgroup="v2")
    with pytest.raises(SandboxUnavailable, match=r"SandboxConfig\.cgroup"):
        SandboxConfig(cgroup="/nonexistent/cgroup").build()


def test_a_run_that_cannot_join_its_cgroup_is_an_error_that_says_so(sandbox):
    slot = sandbox.cgroups.slots[0]
    sandbox.cgroups.slots[0] = Slot(slot.dirs, ("/nonexistent/cgroup.procs",), slot.oom_file)
    try:
        result = sandbox.run("print(1)")
    finally:
        sandbox.cgroups.slots[0] = slot
    assert (result.status, result.stdout) == ("error", "")
    assert result.cause.startswith("sandbox: could not start the run: meshrl-sandbox: cannot join")


# -- a non-root service ------------------------------------------------------------------------------------------

NON_ROOT = r'''
import json, os, resource, sys, threading
sys.path.insert(0, {root!r})
from services.reward.sandbox import SandboxConfig
stop = threading.Event()
for _ in range(40):  # the reward service's own gRPC, executor and tokenizer threads
    threading.Thread(target=stop.wait, daemon=True).start()
box = SandboxConfig().build()
if {starve}:  # the uid may start one more process (the run's first), no second: bwrap cannot start
    tasks = len(os.listdir("/proc/self/task"))
    resource.setrlimit(resource.RLIMIT_NPROC, (tasks + 1, tasks + 1))
result = box.run("print(1)")
print(json.dumps(result.to_json() | {{"aggregate_bound": box.aggregate_bound}}))
'''


def unused_uid() -> int:
    for uid in range(54321, 54421):
        with contextlib.suppress(KeyError):
            pwd.getpwuid(uid)
            continue
        if not any(_owner(status) == uid for status in glob.glob("/proc/[0-9]*/status")):
            return uid
    raise AssertionError("no unused uid in [54321, 54421)")


def _owner(status: str) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(pathlib.Path(status).read_text().split("\nUid:")[1].split()[0])
    return None


def run_as_non_root(starve: bool) -> dict:
    if os.geteuid() != 0:
        pytest.skip("becoming another uid needs root (the suite runs as root in CI)")
    uid = unused_uid()
    script = textwrap.dedent(NON_ROOT.format(root=str(ROOT), starve=starve))
    proc = subprocess.run([SYSTEM_PYTHON, "-c", script], user=uid, group=uid, extra_groups=[], cwd="/",
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_non_root_service_with_many_threads_still_runs_programs():
    out = run_as_non_root(starve=False)
    assert (out["status"], out["stdout"], out["exit_code"]) == ("ok", "1\n", 0), out
    assert out["aggregate_bound"].startswith("none (")  # and it says so, naming what is unbounded


def test_a_run_the_uid_process_limit_stops_is_an_error_that_says_so():
    out = run_as_non_root(starve=True)
    assert out["status"] == "error" and out["stdout"] == "", out
    assert "not the program's fault: the uid's process or thread limit is exhausted" in out["cause"], out
    assert "Resource temporarily unavailable" in out["cause"]
