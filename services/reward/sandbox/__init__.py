"""Untrusted code in a bubblewrap sandbox: no network, a read-only system, a private tmpfs, rlimits, a wall-clock
deadline that kills everything the program started, capped output. See config.py for the limits, pool.py for the
entry point (`Sandbox.run`)."""

from __future__ import annotations

from services.reward.sandbox.config import Limits, SandboxConfig
from services.reward.sandbox.execute import Result
from services.reward.sandbox.pool import Sandbox, SandboxUnavailable, configure, shared_sandbox

__all__ = ["Limits", "Result", "Sandbox", "SandboxConfig", "SandboxUnavailable", "configure", "shared_sandbox"]
