"""F10(c), the program's side: the judged program runs under the sandbox's seccomp deny list, so the kernel surfaces
it opens up where the reward container itself runs without the container engine's seccomp profile (Compose, k8s:
bubblewrap needs unshare and mount) stay closed to it. Each call below fails with EPERM inside the sandbox; with the
filter off, the same calls get past seccomp (they fail later, or succeed), which is what the filter takes away."""

from __future__ import annotations

import errno
import json
import os

import pytest

from services.reward.sandbox import Limits, SandboxConfig, SandboxUnavailable
from services.reward.sandbox import seccomp as sandbox_seccomp

# raw syscalls through libc, so neither Python nor the C library stands in between; x86-64 numbers
PROBE = r"""
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
CALLS = {
    "ptrace": (101, 0, 0, 0, 0),           # PTRACE_TRACEME
    "keyctl": (250, 0, -3, 0, 0),          # KEYCTL_GET_KEYRING_ID of the session keyring
    "bpf": (321, 0, 0, 0, 0),
    "perf_event_open": (298, 0, 0, -1, -1),
    "userfaultfd": (323, 0, 0, 0, 0),
    "io_uring_setup": (425, 1, 0, 0, 0),
    "unshare": (272, 0x00020000, 0, 0, 0),  # CLONE_NEWNS
    "mount": (165, 0, 0, 0, 0),
}
out = {}
for name, (number, *args) in CALLS.items():
    ctypes.set_errno(0)
    rc = libc.syscall(number, *[ctypes.c_long(a) for a in args])
    out[name] = 0 if rc >= 0 else ctypes.get_errno()
print(json.dumps(out))
"""


def run_probe(seccomp: bool) -> dict[str, int]:
    try:
        sandbox = SandboxConfig(limits=Limits(timeout_s=20.0), concurrency=1, seccomp=seccomp).build()
    except SandboxUnavailable as exc:
        pytest.fail(f"{exc} -- the sandbox needs bubblewrap (scripts/install_bwrap.sh) and libseccomp2")
    try:
        result = sandbox.run(PROBE)
    finally:
        sandbox.close()
    assert result.status == "ok", result.stderr
    return json.loads(result.stdout)


def test_the_denied_calls_fail_with_eperm_inside_the_sandbox():
    got = run_probe(seccomp=True)
    assert got == {name: errno.EPERM for name in got}, got


def test_without_the_filter_the_same_calls_get_past_seccomp():
    """The control: the filter is what denies them. ptrace(TRACEME) succeeds and bpf/perf/keyctl answer with their
    own errors (EINVAL, EFAULT, ENOKEY...) instead of seccomp's EPERM."""
    got = run_probe(seccomp=False)
    assert got["ptrace"] == 0, got
    assert sum(code != errno.EPERM for code in got.values()) >= 3, got


def test_ordinary_programs_still_run_under_the_filter():
    sandbox = SandboxConfig(limits=Limits(timeout_s=20.0), concurrency=1).build()
    try:
        code = ("import subprocess, threading, tempfile, socket, json\n"
                "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
                "p = subprocess.run(['/bin/sh', '-c', 'echo child'], capture_output=True, text=True)\n"
                "with tempfile.NamedTemporaryFile('w') as f: f.write('x')\n"
                "a, b = socket.socketpair(); a.send(b'ok'); print(p.stdout.strip(), b.recv(2).decode())\n")
        result = sandbox.run(code)
        assert (result.status, result.stdout) == ("ok", "child ok\n"), result.stderr
    finally:
        sandbox.close()


def test_the_program_is_compiled_once_and_every_run_gets_its_own_descriptor():
    program = sandbox_seccomp.filter_program()
    assert program and len(program) % 8 == 0  # struct sock_filter: 8 bytes an instruction
    first, second = sandbox_seccomp.program_fd(), sandbox_seccomp.program_fd()
    try:
        assert first != second
        assert open(f"/proc/self/fd/{first}", "rb").read() == program
    finally:
        os.close(first)
        os.close(second)
