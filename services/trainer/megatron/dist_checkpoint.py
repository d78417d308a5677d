"""The megatron backend's resumable state through megatron-core's distributed checkpointing.

Every rank writes its own model and optimizer shards as megatron-core's ShardedTensors (global names, global
offsets: layer numbers across stages, experts across expert ranks, columns across tensor ranks), collectively, into
one directory; a trainer of another tp / pp / ep / dp layout loads exactly the pieces its own shards need, so a run
resumes on another layout. AdamW's moments are sharded like their parameters (megatron-core's
``optim_state_to_sharding_state``); its per-parameter step counts are not tensors of the parameter's shape, so they
travel beside, keyed by the parameter's global name and layer / expert offset (``step_key``).

The directory lives inside a meshrl checkpoint (``checkpoint.save_checkpoint(..., directories=...)``), written next
to the Hugging Face files of the same weights, under the same manifest.
"""

from __future__ import annotations

from typing import Any

import torch

DIST = "dist"  # the checkpoint's subdirectory


def cpu_checkpointing() -> None:
    """megatron-core's torch_dist writer copies tensors to the host with ``non_blocking=True`` and then calls
    ``torch.cuda.synchronize()``, which raises on a host without CUDA; there the copy is made blocking (and needs
    no synchronize). Nothing changes where CUDA is present."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if torch.cuda.is_available() or getattr(FileSystemWriterAsync, "_meshrl_host", False):
        return
    preload = FileSystemWriterAsync.preload_tensors

    def blocking(write_buckets, non_blocking=True):
        return preload(write_buckets, non_blocking=False)

    FileSystemWriterAsync.preload_tensors = staticmethod(blocking)
    FileSystemWriterAsync._meshrl_host = True


def in_process_results() -> None:
    """megatron-core's writer collects its write results through a queue of a ``multiprocessing`` Manager, a server
    process it spawns at the first save and that outlives a rank killed (or ended with ``os._exit``) as an orphan
    holding ~300 MB. meshrl saves synchronously, so the results are put and read in this process: a plain queue
    does, and no process is started."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def step_key(sharded) -> str:
    """A parameter's name across layouts: its key and the offsets of its stacked axes (layer, expert). A factory
    (e.g. the fused gate / up projection, saved as two tensors) is named by the first tensor it builds."""
    if not hasattr(sharded, "global_offset"):
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        sharded = next(iter(nested_values(sharded.build())))
    return f"{sharded.key}@{tuple(sharded.global_offset[:sharded.prepend_axis_num])}"


def _sharded(gpt: Any, optimizer: torch.optim.Optimizer) -> tuple[dict, dict[int, Any]]:
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    model = gpt.sharded_state_dict()
    return model, get_param_id_to_sharded_param_map(model, _params(optimizer))


def _with_moments(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter gets AdamW's state (zeros, step 0) where it has none yet, so each has its ShardedTensors:
    a layout that loads a parameter another layout never stepped still finds it."""
    for p in _params(optimizer):
        if not optimizer.state[p]:
            optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def save(gpt: Any, optimizer: torch.optim.Optimizer, directory: str) -> dict[str, float]:
    """Collective: this rank's shards into ``directory`` (which exists on every rank's filesystem: a shared one
    across hosts); returns this rank's step counts by ``step_key``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import optim_state_to_sharding_state

    cpu_checkpointing()
    in_process_results()
    _with_moments(optimizer)
    model, by_id = _sharded(gpt, optimizer)
    optim = optimizer.state_dict()
    steps = {step_key(by_id[i]): float(state["step"]) for i, state in optim["state"].items()}
    optim_state_to_sharding_state(optim, by_id, exclude_keys=("step",))
    dist_checkpointing.save({"model": model, "optimizer": optim}, directory)
    return steps


def load(gpt: Any, optimizer: torch.optim.Optimizer, directory: str, steps: dict[str, float]) -> None:
    """Collective: this rank's shards of the model and AdamW's state from ``directory``, whatever layout wrote it;
    ``steps``: every rank's ``save`` result merged."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import optim_state_to_sharding_state

    _with_moments(optimizer)
    model, by_id = _sharded(gpt, optimizer)
    optim = optimizer.state_dict()
    optim_state_to_sharding_state(optim, by_id, exclude_keys=("step",))
    loaded = dist_checkpointing.load({"model": model, "optimizer": optim}, directory)
    gpt.load_state_dict(loaded["model"], strict=True)
    state = loaded["optimizer"]
    keys = {i: step_key(by_id[i]) for i in state["state"]}
    missing = [key for key in keys.values() if key not in steps]
    if missing:
        raise ValueError(f"checkpoint {directory}: no optimizer step count for {missing[:3]}")
    for i, moments in state["state"].items():
        moments["step"] = torch.tensor(steps[keys[i]], dtype=torch.float32)
    optimizer.load_state_dict(state)
