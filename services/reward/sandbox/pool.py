"""The sandbox: checked at start-up, then up to `concurrency` executions at once, each as its own uid."""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import tempfile
import threading

from services.reward.sandbox import bwrap, execute
from services.reward.sandbox.config import SandboxConfig
from services.reward.sandbox.execute import Result
from services.reward.sandbox.languages import language

INSTALL_HINT = "run scripts/install_bwrap.sh (apt-get install bubblewrap)"


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot build a sandbox here; code is never run unsandboxed instead."""


class Sandbox:
    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        # a distinct uid per slot (and per process) keeps RLIMIT_NPROC, which counts per uid, to one run
        base = config.uid_base + (os.getpid() % 100_000) * 100 if os.geteuid() == 0 else None
        self.uids = [] if base is None else [base + slot for slot in range(config.concurrency)]
        self._slots: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        for slot in range(config.concurrency):
            self._slots.put(self.uids[slot] if self.uids else None)
        self._check()

    def _check(self) -> None:
        if shutil.which(self.config.bwrap) is None:
            raise SandboxUnavailable(f"sandbox: {self.config.bwrap!r} not found on PATH: {INSTALL_HINT}")
        if shutil.which("prlimit") is None:
            raise SandboxUnavailable("sandbox: prlimit not found on PATH (Debian's util-linux package)")
        if not os.access(self.config.python, os.X_OK):
            raise SandboxUnavailable(f"sandbox: no interpreter at {self.config.python!r} (SandboxConfig.python)")
        try:
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
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
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
        cmd = bwrap.command(self.config, lang, program, argv)
        uid = self._slots.get()
        try:
            return execute.run(cmd, stdin, uid, self.config.limits, lang.memory_markers, timeout_s)
        finally:
            self._slots.put(uid)

    async def run_async(self, code: str, stdin: str | bytes = b"", language_name: str = "python",
                        timeout_s: float | None = None) -> Result:
        return await asyncio.to_thread(self.run, code, stdin, language_name, timeout_s)


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
