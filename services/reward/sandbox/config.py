"""Sandbox limits and concurrency."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from services.common.errors import FieldError

if TYPE_CHECKING:
    from services.reward.sandbox.pool import Sandbox

MAX_CONCURRENCY = 100  # each slot gets its own uid (pool.py)
RUN_MEMORY_SLACK_MB = 32  # the kernel's own memory for a run (page tables, pipes, sockets) is charged to its cgroup


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Per execution. The rlimits apply to every process of the run; `nproc` counts the sandbox's own pid 1;
    `run_memory_mb` and the pids bound apply to all of them together (a cgroup, where one can be made)."""

    timeout_s: float = 10.0       # wall clock; past it the whole run is killed (status "timeout")
    cpu_s: int = 10               # RLIMIT_CPU per process (SIGXCPU, then SIGKILL a second later)
    memory_mb: int = 512          # RLIMIT_AS per process
    run_memory_mb: int = 0        # all the run's processes together, tmpfs and SysV shm too; 0: memory_mb + tmp_mb + 32
    nproc: int = 32               # RLIMIT_NPROC in the run's own user namespace: the run's processes (threads count)
    fsize_mb: int = 16            # RLIMIT_FSIZE: the largest file one write may grow
    nofile: int = 64              # RLIMIT_NOFILE
    tmp_mb: int = 64              # size of the private writable /tmp (tmpfs: it lives in RAM)
    max_output_bytes: int = 1 << 20  # per stream; the rest is read and dropped

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "fsize_mb", "tmp_mb", "max_output_bytes"):
            if not getattr(self, name) > 0:
                raise FieldError(name, f"must be > 0, got {getattr(self, name)}")
        if self.run_memory_mb < 0:
            raise FieldError("run_memory_mb", f"must be >= 0 (0: memory_mb + tmp_mb + 32), got {self.run_memory_mb}")
        if self.nproc < 4:
            raise FieldError("nproc", f"must be >= 4 (the sandbox's pid 1 is one), got {self.nproc}")
        if self.nofile < 16:
            raise FieldError("nofile", f"must be >= 16, got {self.nofile}")

    def run_memory_bytes(self) -> int:
        return (self.run_memory_mb or self.memory_mb + self.tmp_mb + RUN_MEMORY_SLACK_MB) << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    limits: Limits = dataclasses.field(default_factory=Limits)
    concurrency: int = 2          # executions at once; more wait for a slot
    python: str = "/usr/bin/python3"  # the system interpreter: /usr is bound read-only, the project's venv is not
    uid_base: int = 1_200_000_000  # sandboxed processes run as uid_base + slot: no host user, no shared nproc count
    bwrap: str = "bwrap"
    cgroup: str = "auto"          # a run's aggregate bound: "auto" (ours, v2 or v1), "off", or a delegated v2 cgroup dir
    seccomp: bool = True          # the program runs under a seccomp deny list (sandbox/seccomp.py; needs libseccomp)

    def __post_init__(self) -> None:
        if not (self.cgroup in ("auto", "off") or self.cgroup.startswith("/")):
            raise FieldError("cgroup", f"must be 'auto', 'off' or an absolute path, got {self.cgroup!r}")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise FieldError("concurrency", f"must be in [1, {MAX_CONCURRENCY}], got {self.concurrency}")
        if not 65536 <= self.uid_base < 2**31 - 10_000_000:
            raise FieldError("uid_base", f"must be in [65536, 2**31 - 1e7) (no real user), got {self.uid_base}")

    def build(self) -> Sandbox:
        """The sandbox, after checking bwrap runs `true` inside it (SandboxUnavailable otherwise)."""
        from services.reward.sandbox.pool import Sandbox

        return Sandbox(self)
