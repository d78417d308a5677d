"""Process groups in tests: every rank started, waited for under one deadline, and killed past it, so a rank
stuck in a collective (its peer died before the rendezvous) never hangs the suite."""

from __future__ import annotations

import multiprocessing
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _reap(procs: Sequence, wait: Callable, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    try:
        for p in procs:
            wait(p, max(1.0, end - time.monotonic()))
    finally:
        for p in procs:
            if (p.poll() if isinstance(p, subprocess.Popen) else p.exitcode) is None:
                p.kill()
                wait(p, None)


def _wait_popen(p: subprocess.Popen, timeout: float | None) -> None:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def run_module_ranks(module: str, world: int, tmp_path: pathlib.Path, args: list[str], *,
                     deadline_s: float = 240) -> list[str]:
    """`python -m module --rank=R --world=W --store=FILE ARGS` for every rank, one rendezvous file; returns the
    failed ranks' stderr tails (empty: every rank exited 0)."""
    store = tmp_path / "rendezvous"
    store.unlink(missing_ok=True)
    logs = [tmp_path / f"rank{r}.err" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, "-m", module, f"--rank={r}", f"--world={world}", f"--store={store}",
                               *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=logs[r].open("w"))
             for r in range(world)]
    _reap(procs, _wait_popen, deadline_s)
    return [f"rank {r} exit {p.returncode}: " + logs[r].read_text()[-3000:]
            for r, p in enumerate(procs) if p.returncode != 0]


def run_spawned(target: Callable, rank_args: Sequence[tuple], *, deadline_s: float) -> list[int | None]:
    """`target(*args)` in one spawned process per entry of `rank_args`; their exit codes (negative: killed)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in rank_args]
    for p in procs:
        p.start()
    _reap(procs, lambda p, timeout: p.join(timeout), deadline_s)
    return [p.exitcode for p in procs]


def join_cpu_group(rank: int, world: int, store: str, timeout_s: float = 120) -> None:
    """A Megatron test rank on CPU: gloo on the rendezvous file, with a bounded wait for the peers."""
    import datetime
    import os

    import torch

    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    if not torch.cuda.is_available():
        # tied embeddings with PP > 1 move the shared weight with `.cuda()` before an all-reduce; stay on CPU
        torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=timeout_s))


def leave_cpu_group() -> None:
    """End a test rank whose results are written: wait for every peer, release the groups, exit 0.

    The barrier keeps a rank from tearing its group down while a peer still uses it. Exiting with `os._exit`
    skips interpreter finalization, where a gloo group still referenced (Megatron's parallel state, a model's
    layers) is destroyed with the GIL already gone; that rarely aborts a finished rank ("terminate called
    without an active exception", exit -6).

    A rank that started a child process and left it running exits 3 instead: `os._exit` would orphan it (megatron-
    core's checkpoint writer once did, with a Manager server per rank).
    """
    import gc
    import multiprocessing
    import os

    import torch.distributed as dist

    dist.barrier()
    try:
        from megatron.core import parallel_state
    except ImportError:
        pass
    else:
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    gc.collect()
    children = multiprocessing.active_children()
    if children:
        print(f"rank left child processes running: {children}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3 if children else 0)
