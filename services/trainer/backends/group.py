"""Joining the trainer's process group: torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK), or one rank on its own; the collective library chosen from the device."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from services.common.device import resolve_device
from services.common.errors import FieldError
from services.trainer.config import TrainerConfig

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def collective_backend(device: str) -> str:
    """gloo on cpu, nccl on cuda, hccl on npu; ValueError naming ``device`` when the library is missing."""
    kind = device.partition(":")[0]
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        if not dist.is_nccl_available():
            raise FieldError("device", f"{device} with ranks needs NCCL, which this torch build lacks")
        return "nccl"
    try:
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
    except ImportError as exc:
        raise FieldError("device", f"{device} needs torch_npu (the Ascend plugin), which is not installed") from exc
    return "hccl"


def env_rank() -> tuple[int, int] | None:
    """(rank, world size) from the environment, or None when it names no group."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        return None
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        raise FieldError("ranks", f"a trainer rank needs {', '.join(ENV)} in its environment; missing {missing}")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device(name: str) -> torch.device:
    """A rank's device: ``cuda`` / ``npu`` without an index is this host's device of the rank's local rank."""
    if ":" not in name and name != "cpu":  # one device per rank on this host
        name = f"{name}:{local_rank()}"
    device = resolve_device(name)
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)
    return device


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def join(config: TrainerConfig) -> bool:
    """Join the process group unless this process is in one already; True when this call created it."""
    if dist.is_initialized():
        if dist.get_world_size() != config.ranks:
            raise FieldError("ranks", f"{config.ranks}, but this process group has {dist.get_world_size()} ranks")
        return False
    found = env_rank()
    timeout = datetime.timedelta(seconds=config.rank_timeout)
    backend = collective_backend(config.device)
    if found is None:
        if config.ranks != 1:
            raise FieldError("ranks", f"{config.ranks} ranks are started by the launcher or torchrun, which set "
                             f"{', '.join(ENV)}; this process has none of them")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return True
    rank, world = found
    if world != config.ranks:
        raise FieldError("ranks", f"{config.ranks}, but WORLD_SIZE is {world}")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return True
