"""LoRA adapters merged inside a server engine's workers (`trainer.lora.sync: adapter` into vLLM / SGLang workers).

An update moves only the adapters (A [r, in] and B [out, r] of every adapted linear, under the trainer's canonical
names): every worker pulls all of them (they are small), then rebuilds each live parameter an adapter touches as
the engine holds it, from the checkpoint's base values of every canonical shard the parameter holds plus
(B @ A) * alpha / r on the adapted ones (as peft merges), and the commit takes those buffers like any pull's (a
packed CPU layer is packed again). The base is read once from the model's safetensors files: the base weights never
change under LoRA, and a packed layer's plain values cannot be read back from the engine.

The rollout sends, with each pull, where each canonical shard lives in this worker (`plan`: local name -> [[canonical
name, canonical offsets, canonical sizes, local offsets, local sizes], ...]), taken from the same formula layout the full sync registers.
Only the standard library, torch and safetensors: this runs in the engine's environment.
"""

from __future__ import annotations

import json
import pathlib

import torch


class CheckpointBase:
    """The base (checkpoint) values of canonical tensors, read on first use and kept."""

    def __init__(self, model_path: str) -> None:
        self.model_path = pathlib.Path(model_path)
        self.tensors: dict[str, torch.Tensor] = {}
        index = self.model_path / "model.safetensors.index.json"
        self.files = json.loads(index.read_text())["weight_map"] if index.exists() else None

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            from safetensors import safe_open

            file = self.model_path / (self.files[name] if self.files else "model.safetensors")
            with safe_open(str(file), framework="pt") as f:
                if name not in f.keys():
                    raise ValueError(f"adapters.plan: {name!r} is not in the checkpoint {file}")
                self.tensors[name] = f.get_tensor(name)
        return self.tensors[name]


def merged_buffers(adapters: dict[str, torch.Tensor], plan: dict, scale: float, base: CheckpointBase,
                   live: dict) -> dict[str, torch.Tensor]:
    """The new value of every live parameter in `plan`, in its logical shape (`live`: name -> (module, tensor,
    logical shape, packed)); rows or columns the plan does not cover (a padded vocabulary) keep the live values."""
    deltas: dict[str, torch.Tensor] = {}

    def delta(canonical: str) -> torch.Tensor | None:
        module = canonical.removesuffix(".weight")
        a, b = adapters.get(f"{module}.lora_A.weight"), adapters.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            return None
        if canonical not in deltas:
            deltas[canonical] = (b.float() @ a.float()) * scale
        return deltas[canonical]

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for local, shards in plan.items():
            if local not in live:
                raise ValueError(f"adapters.plan: {local!r} is not a parameter of this worker")
            _, param, shape, packed = live[local]
            buffer = torch.empty(shape, dtype=param.dtype, device=param.device) if packed else param.clone()
            for canonical, canonical_offsets, canonical_sizes, local_offsets, local_sizes in shards:
                src = tuple(slice(o, o + n) for o, n in zip(canonical_offsets, canonical_sizes, strict=True))
                dst = tuple(slice(o, o + n) for o, n in zip(local_offsets, local_sizes, strict=True))
                value = base.get(canonical)[src].float()
                d = delta(canonical)
                if d is not None:
                    value = value + d[src]
                buffer[dst] = value.reshape(local_sizes).to(buffer.dtype)   # (an expert's: one leading dim)
            out[local] = buffer
    return out


def pull_adapters(job, spec: dict, live: dict, base: CheckpointBase) -> tuple[dict[str, torch.Tensor], object]:
    """Pull the adapters `job` plans for this worker, then merge them: (buffers for the commit, the pull's result).
    spec: {"shapes": {adapter name: shape}, "plan": ..., "scale": alpha / r}."""
    if job.delta_base is not None:
        raise ValueError("delta_base_version: adapters are sent whole (a delta of B @ A is dense)")
    planned = {t.dst_local for t in job.transfers}
    adapters = {name: torch.empty(tuple(spec["shapes"][name]), dtype=torch.float32) for name in sorted(planned)}
    result = job.run(adapters)
    return merged_buffers(adapters, spec["plan"], float(spec["scale"]), base, live), result


def pull_merged(holder, job, spec: dict, rank: int, live: dict) -> tuple[dict[str, torch.Tensor], object]:
    """pull_adapters for worker `rank`, with the checkpoint's base kept on `holder` (the vLLM worker, SGLang's
    model) across updates."""
    if getattr(holder, "_meshrl_base", None) is None:
        holder._meshrl_base = CheckpointBase(spec["model_path"])
    return pull_adapters(job, {**spec, "plan": spec["plans"][str(rank)]}, live, holder._meshrl_base)
