"""HF (canonical checkpoint names) <-> megatron-core GPTModel state, one rank at a time, at any TP x PP x EP x ETP.

The placement of every canonical tensor piece comes from the weight exchange's Megatron layout
(`megatron_shards`), so conversion and weight sync can never disagree. Vocab-parallel tensors are padded to a
multiple of `vocab_divisor * tp`; padding rows are zero on the way in and dropped on the way back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from services.common.errors import FieldError
from services.weight_exchange.client.layouts.common import even, pad_to
from services.weight_exchange.client.layouts.hf import dedupe_tied, hf_shards
from services.weight_exchange.client.layouts.megatron import MegatronParallel, megatron_shards
from services.weight_exchange.client.layouts.model import ModelSpec
from services.weight_exchange.client.layouts.topology import Side, megatron_parallel

VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def rank_parallel(spec: ModelSpec, side: Side, rank: int) -> MegatronParallel:
    """The coordinates of global rank `rank` of a `megatron:tp=..,pp=..,ep=..,etp=..,dp=..` side."""
    if side.framework != "megatron":
        raise FieldError("side", f"expected a megatron side, got {side}")
    if not 0 <= rank < side.world:
        raise FieldError("rank", f"{rank} is outside [0, {side.world}) for {side}")
    return megatron_parallel(side, rank, spec.num_layers)


def padded_vocab(spec: ModelSpec, par: MegatronParallel) -> int:
    return pad_to(spec.vocab_size, par.vocab_divisor * par.tp)


def canonical_state(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A Hugging Face module state dict in canonical names: fused experts split per expert, tied aliases dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, t in dedupe_tied(hf_state).items():
        for s in hf_shards(name, tuple(t.shape), "float32"):
            out[s.canonical_name] = t[s.local_region.slices()].reshape(s.canonical_region.sizes)
    canon = spec.canonical()
    missing = [n for n in canon if n not in out]
    if missing:
        raise FieldError("hf_state", f"{len(missing)} tensors of the model are missing, e.g. {missing[:3]}")
    return {n: out[n] for n in canon}


def to_hf_module(canonical: Mapping[str, torch.Tensor], module_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical tensors laid out as a live transformers module's state dict (fused experts fused again)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in dedupe_tied(module_state).items():
        full = torch.empty(t.shape, dtype=t.dtype)
        for s in hf_shards(name, tuple(t.shape), "float32"):
            if s.canonical_name not in canonical:
                raise FieldError("canonical", f"{s.canonical_name} is missing")
            full[s.local_region.slices()] = canonical[s.canonical_name].reshape(s.local_region.sizes)
        out[name] = full
    return out


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec, par: MegatronParallel,
                   dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The GPTModel state of one rank (names as `GPTModel.state_dict()`), from canonical HF tensors."""
    canon = spec.canonical()
    out: dict[str, torch.Tensor] = {}
    for s in megatron_shards(spec, par):
        src = hf_state.get(s.canonical_name)
        if src is None:
            raise FieldError("hf_state", f"{s.canonical_name} is missing")
        if tuple(src.shape) != canon[s.canonical_name]:
            raise FieldError(f"hf_state[{s.canonical_name}]", f"shape {tuple(src.shape)}, the model has "
                             f"{canon[s.canonical_name]}")
        local = out.get(s.local_name)
        if local is None:
            local = out[s.local_name] = torch.zeros(s.local_shape, dtype=dtype or src.dtype, device=src.device)
        local[s.local_region.slices()] = src[s.canonical_region.slices()].reshape(s.local_region.sizes)
    for name in _vocab_tensors(spec, par):   # a rank may hold only padding rows: no shard names it
        if name not in out:
            like = hf_state[spec.lm_head_name]
            out[name] = torch.zeros((padded_vocab(spec, par) // par.tp, spec.hidden_size), dtype=dtype or like.dtype,
                                    device=like.device)
    return out


def megatron_to_hf(per_rank_states: Mapping[int, Mapping[str, torch.Tensor]] | Sequence[Mapping[str, torch.Tensor]],
                   spec: ModelSpec, side: Side) -> dict[str, torch.Tensor]:
    """Canonical HF tensors from the states of the ranks of `side` (keyed by global rank; a list is ranks 0..n-1).

    Data-parallel replicas may be left out; every canonical element must be held by some given rank.
    Names a rank holds beyond the layout (optimizer-free extras, `_extra_state`) are ignored.
    """
    states = dict(enumerate(per_rank_states)) if isinstance(per_rank_states, Sequence) else dict(per_rank_states)
    canon = spec.canonical()
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, set] = {n: set() for n in canon}
    for rank, state in sorted(states.items()):
        for s in megatron_shards(spec, rank_parallel(spec, side, rank)):
            if s.canonical_region in filled[s.canonical_name]:
                continue    # a replica (dp, or the tied output layer of the last stage)
            local = state.get(s.local_name)
            if local is None:
                raise FieldError(f"per_rank_states[{rank}]", f"{s.local_name} is missing")
            if tuple(local.shape) != s.local_shape:
                raise FieldError(f"per_rank_states[{rank}][{s.local_name}]", f"shape {tuple(local.shape)}, the layout "
                                 f"has {s.local_shape}")
            dst = out.get(s.canonical_name)
            if dst is None:
                dst = out[s.canonical_name] = torch.empty(canon[s.canonical_name], dtype=local.dtype)
            dst[s.canonical_region.slices()] = local.detach()[s.local_region.slices()].reshape(
                s.canonical_region.sizes).to("cpu")
            filled[s.canonical_name].add(s.canonical_region)
    for name, shape in canon.items():
        held = sum(r.numel for r in filled[name])
        total = torch.Size(shape).numel()
        assert held <= total, (name, held, total)  # layout regions of distinct ranks are disjoint
        if held < total:
            raise FieldError("per_rank_states", f"{name} is only partly held ({held} of {total} elements); "
                             f"pass every tp/pp/ep/etp rank of {side}")
    return {n: out[n] for n in canon}


def gather_to_hf(local_state: Mapping[str, torch.Tensor], spec: ModelSpec, side: Side, group=None,
                 dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Collective over every rank of `side` (group rank = global rank of the side): the canonical HF tensors on
    group rank `dst`, None elsewhere. Every rank's state travels whole to `dst` (CPU copies): for export and
    tests, not for weight sync (the weight exchange moves shards directly)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world != side.world:
        raise FieldError("group", f"{world} ranks, {side} has {side.world}")
    mine = {n: t.detach().cpu() for n, t in local_state.items() if torch.is_tensor(t)}
    states: list | None = [None] * world if dist.get_rank(group) == dst else None
    dist.gather_object(mine, states, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)
    return None if states is None else megatron_to_hf(states, spec, side)


def _vocab_tensors(spec: ModelSpec, par: MegatronParallel) -> list[str]:
    even(padded_vocab(spec, par), par.tp, par.tp_rank, "vocab (padded)")
    out = [VOCAB_TENSORS[0]] if par.pp_rank == 0 else []
    if par.pp_rank == par.pp - 1 and (not spec.tie_word_embeddings or par.pp > 1):
        out.append(VOCAB_TENSORS[1])
    return out
