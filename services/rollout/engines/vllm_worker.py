"""Runs inside vLLM's worker process: in-place weight updates for the rollout's vLLM engine.

vLLM loads this class with `--worker-extension-cls services.rollout.engines.vllm_worker.WeightUpdateExtension`
(PYTHONPATH at the repository) and mixes it into its worker; the rollout calls its methods through the dev-mode
route `POST /collective_rpc` (`VLLM_SERVER_DEV_MODE=1`), whose arguments are strings only.

The weights travel through a *stage*: one file in /dev/shm that holds every tensor of the model under its Hugging
Face name, written by the rollout process (the weight exchange's receiver pulls into it in place) and mapped here
without a copy. `load_staged(manifest)` hands those tensors to vLLM's in-place reload (`Worker.reload_weights`
with checkpoint-format weights: the model's own `load_weights`, so fused qkv / gate_up and tied embeddings come out
right, then each layer's post-load processing again, which on CPU re-packs the oneDNN / sgl GEMM weights that
vLLM keeps instead of the plain ones), then re-packs the layers that only share a loaded weight (a tied output
layer: `refresh_cpu_gemms`).

Only the standard library and torch are imported here: this module runs in vLLM's venv.
"""

from __future__ import annotations

import json
import time

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


class WeightUpdateExtension:
    """Mixed into vLLM's worker (`self` is the worker: `reload_weights`, `model_runner`)."""

    def meshrl_load_staged(self, manifest_json: str) -> str:
        """Load every tensor of the stage into the live model, in place. Returns JSON {tensors, bytes, seconds}."""
        started = time.perf_counter()
        manifest = json.loads(manifest_json)
        weights = stage_views(manifest)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        refreshed = refresh_cpu_gemms(self.model_runner.get_model())
        total = sum(t.numel() * t.element_size() for _, t in weights)
        return json.dumps({"tensors": len(weights), "bytes": total, "seconds": time.perf_counter() - started,
                           "cpu_gemms_refreshed": refreshed})

    def meshrl_param_sums(self, names_json: str = "[]") -> str:
        """Sums of the named live parameters (vLLM's names; all when empty), for checks. JSON {name: float}."""
        wanted = set(json.loads(names_json))
        model = self.model_runner.get_model()
        return json.dumps({n: float(p.detach().float().sum()) for n, p in model.named_parameters()
                           if not wanted or n in wanted})
