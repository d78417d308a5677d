"""Parameter counts one rank holds, from the weight exchange's layouts (the shapes each framework's rank
really allocates: FSDP2 dim-0 shards, Megatron TP / PP / EP shards with the padded vocabulary)."""

from __future__ import annotations

import dataclasses
import math

from services.weight_exchange.client.layouts.megatron import megatron_shards, stage_layers
from services.weight_exchange.client.layouts.model import ModelSpec
from services.weight_exchange.client.layouts.topology import Side, megatron_parallel, rank_shards

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class RankParameters:
    numel: int                  # parameters this rank allocates
    largest: int                # its largest tensor (optimizer-step temporaries)
    layers: tuple[int, ...] = ()  # global layer numbers it runs (pipeline stage)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def local_tensors(shards) -> dict[str, tuple[int, ...]]:
    """Local tensor name -> local shape; fused tensors (linear_qkv, linear_fc1) hold several shards once."""
    out: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        assert out.get(shard.local_name, shard.local_shape) == shard.local_shape, shard.local_name
        out[shard.local_name] = shard.local_shape
    return out


def full_parameters(spec: ModelSpec) -> RankParameters:
    shapes = spec.canonical().values()
    return RankParameters(sum(map(numel, shapes)), max(map(numel, shapes)), tuple(range(spec.num_layers)))


def fsdp2_parameters(spec: ModelSpec, dp: int, rank: int) -> RankParameters:
    shards, _ = rank_shards(spec, Side("fsdp2", {"dp": dp}), rank)
    shapes = local_tensors(shards).values()
    return RankParameters(sum(map(numel, shapes)), max(map(numel, shapes)), tuple(range(spec.num_layers)))


def megatron_parameters(spec: ModelSpec, side: Side, rank: int) -> RankParameters:
    par = megatron_parallel(side, rank, spec.num_layers)
    shapes = local_tensors(megatron_shards(spec, par)).values()
    return RankParameters(sum(map(numel, shapes)), max(map(numel, shapes)), tuple(stage_layers(spec, par)))


def layer_numel(spec: ModelSpec, layer: int) -> int:
    return sum(map(numel, spec.layer_tensors(layer).values()))


def root_numel(spec: ModelSpec) -> int:
    """Parameters outside the decoder layers (embeddings, final norm, untied head): FSDP2's root group."""
    return full_parameters(spec).numel - sum(layer_numel(spec, n) for n in range(spec.num_layers))


def linear_numel(spec: ModelSpec) -> int:
    """Weights that go through a matmul (bf16 autocast caches a copy of each): every 2-D layer tensor + the head."""
    layers = sum(numel(s) for n in range(spec.num_layers) for s in spec.layer_tensors(n).values() if len(s) == 2)
    return layers + spec.vocab_size * spec.hidden_size


def lora_numel(spec: ModelSpec, rank: int) -> tuple[int, int]:
    """(adapter parameters, adapted base weights) for LoRA rank ``rank`` on the default target modules."""
    adapters = adapted = 0
    for n in range(spec.num_layers):
        for name, shape in spec.layer_tensors(n).items():
            if len(shape) == 2 and name.split(".")[-2] in LORA_TARGETS:
                adapters += rank * (shape[0] + shape[1])
                adapted += numel(shape)
    return adapters, adapted
