"""OpenMP thread counts per thread, for processes that run a model on a thread of their own (rollout's engine,
the trainer's compute thread). Imports torch: only for the services that run models."""

from __future__ import annotations

import torch


def fix_torch_threads(threads: int) -> None:
    """Fix the calling thread's OpenMP thread count at `threads`. OpenMP keeps one count per thread, and torch sets
    a thread's count lazily from the process-wide one, once: asking for it is what fixes it. A process whose threads
    run parallel ops at different counts holds several OpenMP teams, and once libgomp manages more threads than
    there are CPUs it almost stops spin-waiting (every parallel op ~40% slower on the rollout's engine)."""
    torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads
