"""The ``fsdp2`` backend: the policy sharded with ``torch.distributed.fsdp.fully_shard`` over the data-parallel
ranks (one shard group per decoder layer, plus the root for embeddings and head). Each rank trains its share
of every minibatch (``shards.RowShards``); FSDP averages the gradients. Rank 0 keeps full copies of the weights
under the Hugging Face names for the weight sync and the checkpoints.

Checkpoints: one Hugging Face directory written by rank 0 from those full weights, and the optimizer state as a
full (unsharded) state dict gathered to rank 0 (``torch.distributed.checkpoint.state_dict``, keyed by parameter
name): a checkpoint resumes at any number of ranks."""

from __future__ import annotations

import pathlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from services.common.device import host_copy
from services.trainer.backends import group
from services.trainer.backends.shards import RowShards
from services.trainer.backends.torch_backend import TorchBackend, check_written_for, hf_tensors
from services.trainer.checkpoint import read_state, save_checkpoint
from services.trainer.config import TrainerConfig

GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)  # tied: one key


class FSDP2Backend(TorchBackend):
    def __init__(self, config: TrainerConfig) -> None:
        self.owns_group = group.join(config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.full: dict[str, torch.Tensor] = {}
        super().__init__(config)
        self.shards = RowShards(self.rank, self.world, self.device)
        self.refresh_weights()

    def resolve_device(self) -> torch.device:
        return group.rank_device(self.config.device)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        model.to(self.device).train()
        mesh = init_device_mesh(self.device.type, (self.world,))
        layer_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Collective: every rank gathers each parameter; rank 0 copies it into its full tensors (the same
        objects for the whole run: the weight-sync sender holds them)."""
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if self.rank != 0:
                continue
            if name in self.full:
                self.full[name].copy_(full)
            else:
                self.full[name] = full.clone()

    def local_shards(self) -> tuple[dict[str, torch.Tensor], list]:
        """This rank's live shards (dim-0 rows of each parameter, updated in place by every step) and their
        layout for the weight exchange, read from the DTensor placements."""
        from services.weight_exchange.client.layouts.hf import fsdp2_shards

        params = dict(self.model.named_parameters())
        return {name: p.to_local() for name, p in params.items()}, fsdp2_shards(params, self.rank, self.world)

    def sender_layout(self) -> tuple[str, dict[str, int]]:
        """The framework and parallel coordinates this rank's sender registers its shards under."""
        return "fsdp2", {"dp": self.world}

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: full tensors under the Hugging Face names; other ranks hold none."""
        return self.full

    def save(self, path: str | pathlib.Path, *, version: int, state: dict[str, Any] | None = None,
             lineage: dict[str, Any] | None = None) -> pathlib.Path:
        """Rank 0 only (the full weights are there)."""
        assert self.rank == 0, "checkpoints are written by rank 0"
        return save_checkpoint(self.model, self.tokenizer, path, version=version, state_dict=host_copy(self.full),
                               state=state, lineage=lineage)

    def optimizer_state(self) -> dict[str, Any]:
        """Collective: the full optimizer state on rank 0 (empty elsewhere)."""
        return get_optimizer_state_dict(self.model, self.optimizer, options=GATHERED)

    def restore(self, path: str | pathlib.Path) -> dict[str, Any]:
        """Collective: rank 0 reads the checkpoint and broadcasts it (``path`` matters on rank 0 only); returns
        the saved state on rank 0, {} elsewhere."""
        state: dict[str, Any] = {}
        if self.rank == 0:
            state = read_state(path)
            check_written_for(state["engine"], self.config, path)
        engine = state.get("engine", {})
        set_model_state_dict(self.model, hf_tensors(pathlib.Path(path)) if self.rank == 0 else {}, options=FROM_RANK0)
        set_optimizer_state_dict(self.model, self.optimizer, engine.get("optimizer", {}), options=FROM_RANK0)
        small = [{key: engine.get(key) for key in ("schedule", "rng")}]
        dist.broadcast_object_list(small, src=0)
        self.load_schedule_and_rng(small[0])
        self.refresh_weights()
        return state

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

