"""One sandboxed run: start it in its own process group, read capped output until the wall-clock deadline, kill
the group, classify the outcome."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

from services.reward.sandbox.cgroup import JOIN_FAILED, JOIN_MARKER, Slot
from services.reward.sandbox.config import Limits

STATUSES = ("ok", "timeout", "memory", "killed", "error")
DRAIN_GRACE_S = 2.0  # after a kill, the pipes close as soon as the pid namespace is gone
HOST_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
SETPRIV = shutil.which("setpriv", path=HOST_ENV["PATH"])


@dataclasses.dataclass(frozen=True)
class Result:
    """`ok`: exit 0; `error`: another exit code; `timeout`: past the wall clock or the CPU limit; `memory`: out of
    memory (the language's marker, or the run's cgroup killed one of its processes); `killed`: ended by another
    signal (`exit_code` is then -signal). `cause`: set when the sandbox, not the program, decided the outcome (it
    could not start the run, or the run's aggregate memory bound stopped it); also the last line of `stderr`."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    truncated: bool = False  # some output went past max_output_bytes and was dropped
    cause: str = ""

    def to_json(self) -> dict:
        out = {"status": self.status, "exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
               "wall_seconds": round(self.wall_seconds, 3)}
        return out | ({"cause": self.cause} if self.cause else {})

    def because(self, status: str, cause: str) -> Result:
        stderr = self.stderr + ("" if not self.stderr or self.stderr.endswith("\n") else "\n") + cause + "\n"
        return dataclasses.replace(self, status=status, stderr=stderr, cause=cause)


def run(argv: list[str], stdin: bytes, uid: int | None, limits: Limits, memory_markers: tuple[str, ...] = (),
        timeout_s: float | None = None, cgroup: Slot | None = None, pass_fds: tuple[int, ...] = ()) -> Result:
    """`cgroup`: the slot the run's first process joins (as the caller, before the uid switch) ahead of the rest;
    `pass_fds`: descriptors the run's first process inherits (the seccomp program bwrap reads)."""
    start = time.monotonic()
    deadline = start + (timeout_s or limits.timeout_s)
    argv, user = _as_user(argv, uid)
    if cgroup is not None:
        argv = cgroup.wrap(argv)
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin)
        stdin_file.seek(0)
        proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
                                pass_fds=pass_fds, start_new_session=True, env=HOST_ENV, cwd="/", **user)
    try:
        streams, truncated, timed_out = _collect(proc, deadline, limits.max_output_bytes)
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        _kill(proc)
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    wall = time.monotonic() - start
    out, err = (bytes(s).decode("utf-8", errors="replace") for s in streams)
    status, code = _classify(proc.returncode, timed_out, err, memory_markers)
    result = Result(status, code, out, err, wall, truncated)
    cause = "" if timed_out else setup_failure(proc.returncode, err)
    return result.because("error", cause) if cause else result


def setup_failure(returncode: int, stderr: str) -> str:
    """Why the sandbox could not start the run ("" if it did): bwrap's own error (it exits 1), or the cgroup join.
    A program can fake either line, but only to fail its own run."""
    lines = stderr.splitlines()
    if returncode == JOIN_FAILED and any(line.startswith(JOIN_MARKER) for line in lines):
        return "sandbox: could not start the run: " + next(ln for ln in lines if ln.startswith(JOIN_MARKER))
    bwrap = [line for line in lines if line.startswith("bwrap: ")]
    if returncode != 1 or not bwrap:
        return ""
    why = ("the uid's process or thread limit is exhausted (RLIMIT_NPROC or pids.max of the service), "
           if "Resource temporarily unavailable" in bwrap[-1] else "")
    return f"sandbox: could not start the run, not the program's fault: {why}{bwrap[-1]}"


def _as_user(argv: list[str], uid: int | None) -> tuple[list[str], dict]:
    """Run `argv` as `uid` (group `uid`, no supplementary groups). Through util-linux's `setpriv` where it is
    installed: Popen's own user= switch rules out vfork, so every run would copy the whole reward process
    (~35 ms a spawn against ~10 ms)."""
    if uid is None:
        return argv, {}
    if SETPRIV:
        return [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv], {}
    return argv, {"user": uid, "group": uid, "extra_groups": []}


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[list[bytearray], bool, bool]:
    """Both streams up to `cap` bytes each (the rest read and dropped, so the program never blocks on a full pipe)
    until they close; past `deadline` the run is killed and the pipes drained for a short grace."""
    buffers = [bytearray(), bytearray()]
    truncated = timed_out = False
    with selectors.DefaultSelector() as sel:
        for i, stream in enumerate((proc.stdout, proc.stderr)):
            sel.register(stream.fileno(), selectors.EVENT_READ, i)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:
                    break  # something outside the namespace holds the pipes: give up on them
                timed_out = True
                _kill(proc)
                deadline = time.monotonic() + DRAIN_GRACE_S
                continue
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = buffers[key.data]
                room = cap - len(buf)
                truncated |= len(chunk) > room
                buf += chunk[:max(room, 0)]
    return buffers, truncated, timed_out


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's pid-1 helper first: the pid namespace dies with it, taking every process the program started
    (setsid daemons included), and bwrap reaps it, so no zombie is left to count against the uid's RLIMIT_NPROC.
    Then the group (prlimit -> bwrap) as a backstop; --die-with-parent covers a helper missed in between."""
    for child in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _classify(returncode: int | None, timed_out: bool, stderr: str,
              memory_markers: tuple[str, ...]) -> tuple[str, int | None]:
    if timed_out:
        return "timeout", None
    assert returncode is not None
    # bwrap reports a program killed by signal N as exit code 128 + N
    sig = returncode - 128 if returncode > 128 else (-returncode if returncode < 0 else 0)
    lines = [line for line in stderr.splitlines() if line.strip()]
    if returncode != 0 and lines and lines[-1].startswith(memory_markers):
        return "memory", returncode
    if sig == signal.SIGXCPU:
        return "timeout", -sig
    if sig:
        return "killed", -sig
    return ("ok" if returncode == 0 else "error"), returncode
