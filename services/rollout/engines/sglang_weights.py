"""How the SGLang engine hands new weights to its server: a checkpoint on disk, or a collective broadcast.

disk: `write_checkpoint` writes the stage (the model under its Hugging Face names) as one safetensors file into a
fresh directory beside links to the model's config and tokenizer files; the server then reads it
(`/update_weights_from_disk`). The server must see the same filesystem.

distributed: this process is rank 0 of a process group that the server's tensor-parallel ranks join
(`/init_weights_update_group`, ranks rank_offset=1 ..); each update broadcasts every tensor from rank 0 in the order
of the names sent with `/update_weights_from_distributed`. The group is built as SGLang's workers build theirs
(a TCP rendezvous on master_address:master_port, a store prefixed with the group name, a group that is not the
default one), so both sides meet without a default process group in either process.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

from services.common.errors import FieldError

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def write_checkpoint(tensors: Mapping[str, Any], model_path: str, directory: str, version: int) -> str:
    """`directory`/v<version>: model.safetensors with `tensors` (copied to CPU tensor by tensor) and links to the model's
    other files; older versions there are removed once this one is complete. Returns the new directory."""
    root = pathlib.Path(directory)
    out = root / f"v{version}"
    partial = root / f".v{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in pathlib.Path(model_path).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_FILE_SUFFIXES) and not f.name.endswith(".index.json"):
            os.symlink(f.resolve(), partial / f.name)
    _write_safetensors(tensors, partial / "model.safetensors")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    for old in root.glob("v*"):
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return str(out)


def _write_safetensors(tensors: Mapping[str, Any], path: pathlib.Path) -> None:
    # one copy per tensor: safetensors refuses tensors that share a storage, which the stage's views do
    from safetensors.torch import save_file

    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in SAFETENSORS_DTYPES:
            raise FieldError(name, f"dtype {dtype} cannot be written (expected {', '.join(SAFETENSORS_DTYPES)})")
    save_file({name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}, str(path))


def open_group(address: str, port: int, *, rank: int, world_size: int, backend: str, group_name: str,
               timeout: float):
    """Join (rank 0: host) the weight-update process group; blocks until all `world_size` ranks joined."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    td = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous(f"tcp://{address}:{port}", rank=rank, world_size=world_size,
                                                   timeout=td))
    store.set_timeout(td)
    made = c10d._new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                          group_name=group_name, timeout=td)
    group = made[0] if isinstance(made, tuple) else made
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_tensors(group, tensors: Mapping[str, Any], device: str) -> int:
    """Send every tensor from rank 0 of `group` (copied to `device` first: cuda for nccl); returns bytes sent."""
    import torch.distributed as dist

    sent = 0
    for t in tensors.values():
        on_device = t.detach().to(device, non_blocking=False).contiguous()
        dist.broadcast(on_device, src=0, group=group)
        sent += on_device.numel() * on_device.element_size()
    return sent


def receive_tensors(group, specs: list[tuple[str, str, list[int]]], device: str) -> dict[str, Any]:
    """The other side of `broadcast_tensors` (what a server rank does): (name, dtype, shape) in the sent order."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, dtype, shape in specs:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(t, src=0, group=group)
        out[name] = t
    return out


def close_group(group) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - best effort at shutdown
        pass
