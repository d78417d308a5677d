"""Trajectory staleness, one definition for the builder (admission to a batch) and the trainer (metrics).

A trajectory (or a group of them) is as old as its oldest generated token: staleness = the version it trains
at - the lowest policy version that sampled one of its tokens. Tokens the policy did not generate (version
-1: prompt, tool output) do not count; with none generated, the staleness is 0. Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable


def oldest_version(versions: Iterable[int]) -> int | None:
    """The lowest version >= 0 among per-token ``versions``; None when no token was generated."""
    return min((v for v in versions if v >= 0), default=None)


def staleness(versions: Iterable[int], train_version: int) -> int:
    """``train_version`` - the oldest generated token's version (0 when none was generated)."""
    oldest = oldest_version(versions)
    return 0 if oldest is None else train_version - oldest
