"""The sandbox: checked at start-up, then up to `concurrency` executions at once, each as its own uid (as root) and
in its slot's cgroup (where one can be made: cgroup.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref

from services.common.errors import FieldError
from services.reward.sandbox import bwrap, execute, seccomp
from services.reward.sandbox.cgroup import JOIN_MARKER, MB, Cgroups, CgroupUnavailable
from services.reward.sandbox.config import SandboxConfig
from services.reward.sandbox.execute import Result
from services.reward.sandbox.languages import language

INSTALL_HINT = "run scripts/install_bwrap.sh (apt-get install bubblewrap)"
# How long a run waits for a free slot: each holder is bounded by its wall-clock limit and the kill after it.
# Past it the run raises (not the program's fault: the message is retried, not scored).
SLOT_TIMEOUT_S = 600.0
PIDS_SLACK = 2  # the cgroup's pids bound also counts bwrap outside the namespace
log = logging.getLogger(__name__)


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot build a sandbox here; code is never run unsandboxed instead."""


class Sandbox:
    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        # a distinct uid per slot (and per process): a run cannot signal, ptrace or read the files of another run
        # or of the service (RLIMIT_NPROC no longer needs it: it is counted in the run's own user namespace)
        base = config.uid_base + (os.getpid() % 100_000) * 100 if os.geteuid() == 0 else None
        self.uids = [] if base is None else [base + slot for slot in range(config.concurrency)]
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(config.concurrency):
            self._slots.put(slot)
        self.cgroups: Cgroups | None = None
        self.aggregate_bound = self._bound()  # what bounds a run's processes together, or "none: why"
        if not self.uids and kernel_version() < (5, 14):
            log.warning("sandbox: Linux %s counts RLIMIT_NPROC per uid, not per user namespace: as a non-root "
                        "service, a run's nproc also counts the service's own threads", os.uname().release)
        try:
            self._check()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Removes the slots' cgroups (also done when the sandbox is collected or the process exits)."""
        if self.cgroups is not None:
            self.cgroups.close()

    def _bound(self) -> str:
        limits = self.config.limits
        try:
            if self.config.cgroup == "off":
                raise CgroupUnavailable("SandboxConfig.cgroup is 'off'")
            if self.uids and execute.SETPRIV is None:
                raise CgroupUnavailable("setpriv (util-linux) is missing: a run cannot join its cgroup before "
                                        "dropping to its uid")
            self.cgroups = Cgroups(self.config.cgroup, self.config.concurrency, limits.run_memory_bytes(),
                                   limits.nproc + PIDS_SLACK)
        except (CgroupUnavailable, OSError) as exc:
            if self.config.cgroup not in ("auto", "off"):
                raise SandboxUnavailable(f"sandbox: cgroup {self.config.cgroup!r} (SandboxConfig.cgroup): {exc}") from exc
            return self._unbounded(str(exc))
        weakref.finalize(self, self.cgroups.close)
        return self.cgroups.description

    def _unbounded(self, why: str) -> str:
        limits = self.config.limits
        self.cgroups = None
        bound = (f"none ({why}): a run's processes together are bounded only by nproc x memory_mb = "
                 f"{limits.nproc * limits.memory_mb} MiB of address space, and SysV shared memory and memfds are "
                 f"outside RLIMIT_AS entirely; run the service as root, or give it a delegated cgroup v2 "
                 f"(SandboxConfig.cgroup)")
        log.warning("sandbox: no aggregate memory/pids bound per run: %s", bound)
        return bound

    def _check(self) -> None:
        if shutil.which(self.config.bwrap) is None:
            raise SandboxUnavailable(f"sandbox: {self.config.bwrap!r} not found on PATH: {INSTALL_HINT}")
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("sandbox: prlimit not found on PATH (Debian's util-linux package)")
        if not os.access(self.config.python, os.X_OK):
            raise SandboxUnavailable(f"sandbox: no interpreter at {self.config.python!r} (SandboxConfig.python)")
        if self.config.seccomp:
            try:
                seccomp.filter_program()
            except seccomp.SeccompUnavailable as exc:
                raise SandboxUnavailable(f"sandbox: no seccomp filter for the programs (SandboxConfig.seccomp): "
                                         f"{exc}") from exc
        try:
            result = self._run(None, b"", "python", None, argv=["true"])
            if self.cgroups is not None and JOIN_MARKER in result.cause and self.config.cgroup == "auto":
                self.cgroups.close()  # the cgroup was made but cannot be joined: run without, and say so
                self.aggregate_bound = self._unbounded(result.cause)
                result = self._run(None, b"", "python", None, argv=["true"])
        except OSError as exc:
            raise SandboxUnavailable(f"sandbox: cannot start bwrap: {exc}") from exc
        if result.status != "ok":
            why = (result.stderr.strip() or result.status)[-500:]
            raise SandboxUnavailable(f"sandbox: bwrap cannot run `true` in a sandbox here: {why}")

    def run(self, code: str, stdin: str | bytes = b"", language_name: str = "python",
            timeout_s: float | None = None) -> Result:
        """Run `code` to completion or its deadline (`timeout_s`, else the configured one); blocks the thread, and
        waits for a free slot when `concurrency` runs are already going."""
        lang = language(language_name)
        if timeout_s is not None and not timeout_s > 0:
            raise FieldError("timeout_s", f"must be > 0, got {timeout_s}")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        with tempfile.TemporaryDirectory(prefix="meshrl-sandbox-") as host_dir:
            os.chmod(host_dir, 0o711)  # the unprivileged bwrap must reach the file it binds, but not list the dir
            program = os.path.join(host_dir, lang.filename)
            with open(program, "w", encoding="utf-8") as f:
                f.write(code)
            os.chmod(program, 0o644)
            return self._run(program, data, language_name, timeout_s)

    def _run(self, program: str | None, stdin: bytes, language_name: str, timeout_s: float | None,
             argv: list[str] | None = None) -> Result:
        lang = language(language_name)
        try:
            slot = self._slots.get(timeout=SLOT_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"sandbox: none of {self.config.concurrency} slots free within "
                               f"{SLOT_TIMEOUT_S:g}s") from None
        filter_fd = seccomp.program_fd() if self.config.seccomp else None
        try:
            cmd = bwrap.command(self.config, lang, program, argv, filter_fd)
            uid = self.uids[slot] if self.uids else None
            cgroup = self.cgroups.slots[slot] if self.cgroups else None
            kills = cgroup.oom_kills() if cgroup else 0
            result = execute.run(cmd, stdin, uid, self.config.limits, lang.memory_markers, timeout_s, cgroup,
                                 pass_fds=() if filter_fd is None else (filter_fd,))
            return self._out_of_memory(result, cgroup.oom_kills() - kills) if cgroup else result
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
            self._slots.put(slot)

    def _out_of_memory(self, result: Result, kills: int) -> Result:
        """`memory` when the kernel killed processes of the run at the run's memory bound (the OOM killer's SIGKILL
        says nothing by itself)."""
        if kills <= 0 or result.cause:
            return result
        assert self.cgroups is not None
        return result.because("memory", f"sandbox: the run's processes together reached its memory bound "
                                        f"({self.cgroups.memory_bytes // MB} MiB, tmpfs and shared memory included): "
                                        f"the kernel killed {kills}")

    async def run_async(self, code: str, stdin: str | bytes = b"", language_name: str = "python",
                        timeout_s: float | None = None) -> Result:
        return await asyncio.to_thread(self.run, code, stdin, language_name, timeout_s)


def kernel_version() -> tuple[int, int]:
    major, minor, *_ = (os.uname().release.split("-")[0] + ".0.0").split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


_shared: dict[SandboxConfig, Sandbox] = {}
_default = SandboxConfig()
_lock = threading.Lock()


def configure(config: SandboxConfig) -> None:
    """The config `shared_sandbox()` (and so every code verifier) uses; the reward service sets its own."""
    global _default
    with _lock:
        _default = config


def shared_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """One checked sandbox per config per process (its slots bound concurrency across every caller)."""
    with _lock:
        config = config or _default
        if config not in _shared:
            _shared[config] = config.build()
        return _shared[config]
