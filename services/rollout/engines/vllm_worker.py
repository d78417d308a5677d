"""Runs inside vLLM's worker processes: in-place weight updates for the rollout's vLLM engine.

vLLM loads this class with `--worker-extension-cls services.rollout.engines.vllm_worker.WeightUpdateExtension`
(PYTHONPATH at the repository) and mixes it into every worker; the rollout calls its methods through the dev-mode
route `POST /collective_rpc` (`VLLM_SERVER_DEV_MODE=1`), whose arguments are strings only. Every worker runs each
call and answers for itself (one result per worker, in rank order).

Two ways for weights to arrive (`engine.vllm.weight_path`):

- **worker** (the default): each worker is the weight exchange's data-plane receiver of its own shard.
  `meshrl_live_params()` reports what the worker holds, as vLLM holds it (fused `qkv_proj` / `gate_up_proj`, padded
  vocabulary, this TP rank's slice); the rollout registers that as the receiver's layout, so the coordinator plans
  exactly these bytes. At an update `meshrl_pull(job)` pulls them from the trainer's senders (CMA / shm / tcp, with
  the coordinator's tickets) straight into the live parameters. A linear layer whose weight vLLM's CPU backend has
  packed into a private GEMM format after loading (oneDNN / sgl kernels; the plain weight is then empty) never takes
  raw bytes: its shard lands in a buffer of the layer's logical shape, then the layer's own
  `quant_method.process_weights_after_loading` packs it again; a MoE layer's experts, which the CPU MoE kernel
  prepacks after loading, land plain and its kernel's own post-load step prepacks them again
  (`repack_experts`). Nothing is staged for the whole model, no file.
- **stage**: one file in /dev/shm holds every tensor of the model under its Hugging Face name, written by the
  rollout process and mapped here without a copy; `meshrl_load_staged(manifest)` hands those tensors to vLLM's
  in-place reload (`Worker.reload_weights` with checkpoint-format weights, then each layer's post-load processing).

Both end with `refresh_cpu_gemms`: a layer that only shares a loaded weight (the output layer tied to the
embedding) is packed again too.

Only the standard library and torch are imported at the top: this module runs in vLLM's venv. `meshrl_pull` imports
the weight exchange's data plane (`services.weight_exchange.client.sink`: torch, msgpack), never its gRPC agents.
"""

from __future__ import annotations

import collections
import json
import math
import time
from typing import NamedTuple

import torch

STAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stage_views(manifest: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry of a stage manifest, viewing the mapped file (no copy).

    manifest: {"path": str, "size": int, "tensors": [[name, dtype, shape, offset], ...]}."""
    size = int(manifest["size"])
    buf = torch.from_file(manifest["path"], shared=True, size=size, dtype=torch.uint8)
    out = []
    for name, dtype, shape, offset in manifest["tensors"]:
        dt = STAGE_DTYPES[dtype]
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.tensor([], dtype=dt).element_size()
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"stage manifest: {name} [{offset}, {offset + nbytes}) is outside the stage ({size} B)")
        out.append((name, buf[offset:offset + nbytes].view(dt).view(*[int(d) for d in shape])))
    return out


def refresh_cpu_gemms(model: torch.nn.Module) -> int:
    """CPU builds: vLLM multiplies by a packed copy of each linear weight (oneDNN / sgl kernels, made when the layer
    is processed after loading). The reload re-processes every layer it loaded, but a layer that only shares a
    loaded weight is left alone: the output layer tied to the embedding (`lm_head.weight` is not in the checkpoint)
    would keep multiplying by the old embedding. Re-pack every layer that still holds its plain 2-D weight next to a
    packed one (the embedding-like layers; linear layers drop theirs). Returns how many were re-packed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 \
                and weight.numel() > 0 and not weight.is_meta:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count


def _packed(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """A linear layer whose weight the CPU backend moved into a packed copy (and emptied) after loading."""
    return hasattr(module, "cpu_linear") and param.numel() == 0 and hasattr(module, "output_size")


def _linear_shape(module: torch.nn.Module) -> tuple[int, int]:
    """A linear layer's weight shape on this rank: its partition's under tensor parallelism, the whole for a
    replicated one (e.g. a MoE router's gate), which has no partition sizes."""
    return (int(getattr(module, "output_size_per_partition", module.output_size)),
            int(getattr(module, "input_size_per_partition", module.input_size)))


EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def _prepacked_experts(module: torch.nn.Module) -> bool:
    """A MoE layer's experts that the CPU backend re-laid out after loading (`cpu_prepack_moe_weight`: the same
    shape, or its intermediate size padded, in the kernel's blocked order). Raw bytes never go into them: both
    weights are rebuilt from their plain values and packed again by the kernel's own post-load step."""
    if not hasattr(module, "w13_weight") or not hasattr(module, "moe_config"):
        return False
    from vllm.platforms import current_platform

    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return current_platform.is_cpu() and experts is not None and not getattr(experts, "_use_zentorch", False)


def _experts_shape(module: torch.nn.Module, leaf: str) -> tuple[int, ...]:
    """The plain (checkpoint-order, unpadded) shape of a MoE layer's local experts."""
    c = module.moe_config
    inter = int(c.intermediate_size_per_partition_unpadded or c.intermediate_size_per_partition)
    hidden = int(c.hidden_dim_unpadded or c.hidden_dim)
    return (int(c.num_local_experts), 2 * inter, hidden) if leaf == "w13_weight" else \
        (int(c.num_local_experts), hidden, inter)


def repack_experts(module: torch.nn.Module, plain: dict[str, torch.Tensor]) -> None:
    """A prepacked MoE layer takes plain `w13_weight` / `w2_weight` and runs its kernel's post-load step (pad,
    prepack) again, as at load. (vLLM's own `process_weights_after_loading` sets the kernel up only once: on a
    second call it copies the weights in and skips the prepack, so it is not the way in.)"""
    from vllm.model_executor.utils import replace_parameter

    for leaf in EXPERT_WEIGHTS:
        replace_parameter(module, leaf, plain[leaf])
    _prepack_experts(module)


def _prepack_experts(module: torch.nn.Module) -> None:
    """The CPU MoE kernel's own post-load step (pad, prepack) on the layer's current, plain experts."""
    module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)


def prepack_reloaded_experts(model: torch.nn.Module) -> int:
    """After vLLM's in-place reload: its second post-load pass copies a MoE layer's new experts in plain and skips
    the CPU kernel's prepack, so the kernel would read plain values as packed ones. Prepack them again (the kernel's
    own post-load step). A layer whose kernel pads the experts cannot be reloaded so (its tensors already hold the
    padded shape): refused, naming weight_path worker. Returns how many layers were prepacked."""
    count = 0
    for name, module in model.named_modules():
        if not _prepacked_experts(module):
            continue
        if tuple(module.w13_weight.shape) != _experts_shape(module, "w13_weight"):
            raise RuntimeError(f"{name}: the CPU MoE kernel pads these experts; the stage path cannot reload them "
                               "(engine.vllm.weight_path: worker can)")
        _prepack_experts(module)
        count += 1
    return count


def live_params(model: torch.nn.Module, transposed=()) -> dict[str, tuple[torch.nn.Module, torch.Tensor,
                                                                          tuple[int, ...], bool]]:
    """name -> (owning module, the tensor updates write, logical shape, packed) for every parameter vLLM holds (a
    tied weight once, under its first name, as `named_parameters()` gives it). `transposed`: names the engine keeps
    transposed after loading (vLLM-Ascend's fused experts): their tensor is the `.transpose(-2, -1)` view of the
    parameter, in the layout's logical shape."""
    out = {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        tensor = param.data.transpose(-2, -1) if name in transposed else param.data
        if leaf in EXPERT_WEIGHTS and _prepacked_experts(module):
            packed, shape = True, _experts_shape(module, leaf)
        else:
            packed = leaf == "weight" and _packed(module, param)
            shape = _linear_shape(module) if packed else tuple(int(d) for d in tensor.shape)
        out[name] = (module, tensor, shape, packed)
    return out


def planned_elements(transfers) -> collections.Counter:
    """Elements of each local tensor that `transfers` write (the planner's regions of one receiver are disjoint)."""
    counts: collections.Counter = collections.Counter()
    for t in transfers:
        counts[t.dst_local] += t.dst_region.numel
    return counts


def job_for(raw: dict, rank: int):
    """The PullJob in `raw` (PullJob.to_json() plus `prefix_by_rank`: local names are `w<rank>/...` when the engine
    has several workers) with only this worker's transfers, under the names it holds them by."""
    import dataclasses

    from services.weight_exchange.client.sink import PullJob

    job = PullJob.from_json(raw)
    prefix = f"w{rank}/" if raw.get("prefix_by_rank") else ""
    job.transfers = [dataclasses.replace(t, dst_local=t.dst_local[len(prefix):])
                     for t in job.transfers if t.dst_local.startswith(prefix)]
    return job


def pull_buffers(job, live: dict, shadow: dict, who: str) -> dict[str, torch.Tensor]:
    """Where a pull lands: a buffer in its logical shape for every parameter `job` writes (`live`: name ->
    (module, tensor, logical shape, packed), as `live_params` gives it). Empty when every element arrives, the
    current values when only some do (the padded rows of a vocabulary shard keep theirs) or when the job is a
    delta (it sets the changed elements of what is held; a packed layer's plain values are only in `shadow`)."""
    buffers: dict[str, torch.Tensor] = {}
    planned = planned_elements(job.transfers)
    for name in sorted(planned):
        if name not in live:
            raise ValueError(f"transfers.dst_local_name: {name!r} is not a parameter of {who}")
        _, param, shape, packed = live[name]
        if job.delta_base is not None:
            current = shadow.get(name) if packed else param
            if current is None:
                raise ValueError(f"delta_base_version: {who} keeps no plain copy of packed {name}: "
                                 "a full update is needed")
            buffers[name] = current.clone()
        elif planned[name] == math.prod(shape):
            buffers[name] = torch.empty(shape, dtype=param.dtype, device=param.device)   # contiguous
        elif not packed:
            buffers[name] = param.clone()
        else:
            # a packed layer is rebuilt from its buffer alone: every element must arrive
            raise ValueError(f"transfers: packed {name} must be sent whole to {who} "
                             f"({planned[name]} of {math.prod(shape)} elements planned)")
    return buffers


class Pending(NamedTuple):
    """What a pull leaves for the commit."""

    sync_id: str
    buffers: dict[str, torch.Tensor]    # local name -> the new values, in the layout's logical shape
    track: bool                         # deltas are on: keep the packed layers' plain values
    delta: bool                         # the buffers started from the current values
    transposed: tuple[str, ...]         # names held transposed after loading


class WeightUpdateExtension:
    """Mixed into vLLM's worker (`self` is the worker: `rank`, `reload_weights`, `model_runner`)."""

    def meshrl_live_params(self) -> str:
        """What this worker holds, for its receiver layout. JSON {rank, tp, tp_rank, params: [[name, shape,
        dtype, packed], ...]} (shapes logical: a packed layer's as vLLM loaded it)."""
        from vllm.distributed import parallel_state as ps

        model = self.model_runner.get_model()
        params = [[name, list(shape), str(param.dtype).removeprefix("torch."), packed]
                  for name, (_, param, shape, packed) in live_params(model).items()]
        return json.dumps({"rank": int(self.rank), "tp": ps.get_tensor_model_parallel_world_size(),
                           "tp_rank": ps.get_tensor_model_parallel_rank(), "params": params})

    def meshrl_pull(self, job_json: str) -> str:
        """Phase one of an update: pull this worker's planned bytes from the senders into buffers of its
        parameters' logical shapes (kept until `meshrl_commit` or `meshrl_discard`; the live weights are untouched,
        so a pull that fails anywhere leaves every worker serving the old version whole). job: PullJob.to_json()
        plus `prefix_by_rank` (local names `w<rank>/...`: the engine has several workers); only this worker's
        transfers are taken. Returns JSON {bytes_received, seconds, checksum, tensors}."""
        started = time.perf_counter()
        raw = json.loads(job_json)
        job = job_for(raw, int(self.rank))
        transposed = tuple(raw.get("transposed", ()))
        live = live_params(self.model_runner.get_model(), transposed)
        self._meshrl_pending = None
        if "adapters" in raw:   # LoRA: pull the adapters, merge them into buffers of the parameters they touch
            from services.rollout.engines.worker_adapters import pull_merged

            buffers, result = pull_merged(self, job, raw["adapters"], int(self.rank), live)
            self._meshrl_pending = Pending(job.sync_id, buffers, False, False, transposed)
        else:
            buffers = pull_buffers(job, live, getattr(self, "_meshrl_shadow", {}), f"worker {self.rank}")
            result = job.run(buffers)
            self._meshrl_pending = Pending(job.sync_id, buffers, job.track, job.delta_base is not None, transposed)
        return json.dumps({"bytes_received": result.bytes_received, "bytes_full": result.bytes_full,
                           "seconds": time.perf_counter() - started, "checksum": result.checksum,
                           "tensors": len(buffers)})

    def meshrl_commit(self, sync_id: str) -> str:
        """Phase two: the pulled buffers become the live weights: copied into plain parameters in place; a packed
        layer takes its buffer as its weight and is packed again by its own post-load processing. Returns JSON
        {in_place, packed, seconds}."""
        started = time.perf_counter()
        pending = getattr(self, "_meshrl_pending", None)
        if pending is None or pending.sync_id != sync_id:
            raise RuntimeError(f"worker {self.rank}: nothing pulled for update {sync_id}")
        self._meshrl_pending = None
        model = self.model_runner.get_model()
        live = live_params(model, pending.transposed)
        in_place = packed = unchanged = 0
        # with deltas on, a packed layer's plain values are kept (the packed copy cannot be read back): the
        # base the next delta is applied to
        shadow = self.__dict__.setdefault("_meshrl_shadow", {})
        if not pending.track:
            shadow.clear()
        experts: dict[str, torch.nn.Module] = {}     # prepacked MoE layers: both weights go in, then one repack
        with torch.no_grad():
            for name, buffer in pending.buffers.items():
                module, param, _, is_packed = live[name]
                if pending.delta and torch.equal(buffer, shadow[name] if is_packed else param):
                    unchanged += 1      # nothing of it changed: no copy, no re-packing
                    continue
                prefix, _, leaf = name.rpartition(".")
                if is_packed and leaf in EXPERT_WEIGHTS:
                    experts[prefix] = module
                elif is_packed:
                    module.weight = torch.nn.Parameter(buffer, requires_grad=False)
                    module.quant_method.process_weights_after_loading(module)
                    if pending.track:
                        shadow[name] = buffer
                    packed += 1
                else:
                    param.copy_(buffer)     # the parameter's memory (through the view when transposed)
                    in_place += 1
            for prefix, module in experts.items():
                plain = {leaf: pending.buffers.get(f"{prefix}.{leaf}", shadow.get(f"{prefix}.{leaf}"))
                         for leaf in EXPERT_WEIGHTS}
                missing = [leaf for leaf, tensor in plain.items() if tensor is None]
                if missing:   # (planned whole at every update: a receiver's tensors are all planned)
                    raise RuntimeError(f"worker {self.rank}: {prefix} has no plain {missing} to repack with")
                repack_experts(module, plain)
                if pending.track:
                    shadow.update({f"{prefix}.{leaf}": tensor for leaf, tensor in plain.items()})
                packed += 1
            if in_place:    # a plain weight changed: re-pack what shares it (the tied output layer)
                refresh_cpu_gemms(model)
        return json.dumps({"in_place": in_place, "packed": packed, "unchanged": unchanged,
                           "seconds": time.perf_counter() - started})

    def meshrl_discard(self) -> str:
        """Drop what a pull left for a commit (the update was abandoned)."""
        self._meshrl_pending = None
        return "{}"

    def meshrl_load_staged(self, manifest_json: str) -> str:
        """Load every tensor of the stage into the live model, in place. Returns JSON {tensors, bytes, seconds}."""
        started = time.perf_counter()
        manifest = json.loads(manifest_json)
        weights = stage_views(manifest)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        refreshed = refresh_cpu_gemms(model)
        experts = prepack_reloaded_experts(model)
        total = sum(t.numel() * t.element_size() for _, t in weights)
        return json.dumps({"tensors": len(weights), "bytes": total, "seconds": time.perf_counter() - started,
                           "cpu_gemms_refreshed": refreshed, "experts_repacked": experts})

    def meshrl_param_sums(self, names_json: str = "[]") -> str:
        """Sums of the named live parameters (vLLM's names; all when empty), for checks. JSON {name: float}."""
        wanted = set(json.loads(names_json))
        model = self.model_runner.get_model()
        return json.dumps({n: float(p.detach().float().sum()) for n, p in model.named_parameters()
                           if not wanted or n in wanted})
