"""Hugging Face layouts: a full model on one rank, FSDP2 dim-0 shards, the embedded engine (full).

transformers 5 keeps MoE experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]); they map to the checkpoint's per-expert names `mlp.experts.{e}.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from services.common.errors import FieldError
from services.weight_exchange.client.layout import Shard, dtype_name, full_shard
from services.weight_exchange.client.regions import Region

_FUSED_GATE_UP = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.mlp\.experts)\.down_proj$")


def dedupe_tied(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop later names that alias an earlier tensor (tied embeddings in a state_dict)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in params.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def hf_shards(name: str, shape: tuple[int, ...], dtype: str) -> list[Shard]:
    """Shards of one full HF module tensor (fused experts become per-expert canonical tensors)."""
    if (m := _FUSED_GATE_UP.match(name)) and len(shape) == 3:
        experts, two_i, hidden = shape
        inter = two_i // 2
        out = []
        for e in range(experts):
            for k, part in enumerate(("gate_proj", "up_proj")):
                out.append(Shard(f"{m.group(1)}.{e}.{part}.weight", (inter, hidden), dtype, Region.full((inter, hidden)),
                                 name, shape, Region((e, k * inter, 0), (1, inter, hidden))))
        return out
    if (m := _FUSED_DOWN.match(name)) and len(shape) == 3:
        experts, hidden, inter = shape
        return [Shard(f"{m.group(1)}.{e}.down_proj.weight", (hidden, inter), dtype, Region.full((hidden, inter)),
                      name, shape, Region((e, 0, 0), (1, hidden, inter))) for e in range(experts)]
    return [full_shard(name, shape, dtype)]


def hf_full_shards(params: Mapping[str, torch.Tensor]) -> list[Shard]:
    """Every tensor of a full (unsharded) Hugging Face model on one rank."""
    shards: list[Shard] = []
    for name, t in dedupe_tied(params).items():
        shards.extend(hf_shards(name, tuple(t.shape), dtype_name(t.dtype)))
    return shards


def fsdp2_shards(params: Mapping[str, torch.Tensor], dp_rank: int, dp_size: int,
                 canonical: Mapping[str, tuple[int, ...]] | None = None) -> list[Shard]:
    """FSDP2 (`fully_shard`) dim-0 shards: rank r holds rows [r*c, min((r+1)*c, n)) with c = ceil(n / dp_size).

    `params` values are DTensors (their global shape is read) or local tensors with `canonical` shapes given.
    """
    if not 0 <= dp_rank < dp_size:
        raise FieldError("dp_rank", f"{dp_rank} is outside [0, {dp_size})")
    shards: list[Shard] = []
    for name, t in params.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        shape = tuple(t.shape) if hasattr(t, "to_local") else tuple((canonical or {}).get(name, ()))
        if not shape:
            raise FieldError("canonical", f"no global shape for {name} (pass DTensors or a canonical shape map)")
        rows = shape[0] if shape else 1
        chunk = -(-rows // dp_size)
        start, stop = min(dp_rank * chunk, rows), min((dp_rank + 1) * chunk, rows)
        if tuple(local.shape) != (stop - start, *shape[1:]):
            raise FieldError(f"params[{name}]", f"local shape {tuple(local.shape)} is not rows {start}:{stop} of {shape}")
        if stop == start:
            continue
        for s in hf_shards(name, shape, dtype_name(local.dtype)):
            if s.local_region.ndim != s.canonical_region.ndim:
                raise FieldError(f"params[{name}]", "FSDP2 shards of fused experts are not supported")
            box = Region((start,) + (0,) * (len(shape) - 1), (stop - start, *shape[1:]))
            shards.append(Shard(s.canonical_name, s.canonical_shape, s.dtype, box, name, tuple(local.shape),
                                Region((0,) * len(shape), box.sizes)))
    return shards
