"""A receiver's layout from what the live engine actually holds, checked against the formula layout.

The formula layouts (`inference.inference_shards`) say what a vLLM / vLLM-Ascend / SGLang rank *should* hold for a
model and a parallel configuration. An engine may differ (a newer version, a model variant, a kernel that
reshapes), so a receiver reports what it holds and registers a layout built from that: `live_layout` takes the
parameters it has (`named_parameters()`: names, shapes, dtypes) and its parallel state (tp / ep / dp ranks, the
expert map, the pipeline layer range), computes the formula layout for that state, and raises `LayoutMismatch`
naming every missing / extra tensor and every shape that differs. The shards it returns carry the live dtypes.

Inside a vLLM worker (e.g. a worker extension, after the model is loaded)::

    from services.weight_exchange.client.layouts.live import live_layout, receiver_views
    from vllm.distributed import parallel_state as ps

    model = self.model_runner.model
    params = dict(model.named_parameters())
    moe = ...  # any FusedMoE layer of the model (None for dense models)
    layout = live_layout(
        f"rollout-{replica}-{ps.get_world_group().rank}", params, spec, "vllm",   # spec = model_spec(config path)
        tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
        edp=vllm_config.parallel_config.data_parallel_size, edp_rank=vllm_config.parallel_config.data_parallel_rank,
        ep=moe.ep_size if moe is not None else 1,
        expert_map=moe.expert_map if moe is not None and moe.expert_map is not None else None,
        layers=(model.model.start_layer, model.model.end_layer),
        dp=num_replicas, dp_rank=replica)
    agent = ReceiverAgent(layout.rank_id, receiver_views("vllm", params), wx_address, shards=layout.shards,
                          framework=layout.framework, parallel=layout.parallel, ...)

`receiver_views` turns the post-load-transposed tensors of vLLM-Ascend into views in the layout's (logical)
shapes; for other engines it returns the parameters as they are. A receiver whose backend rearranges weights into a
private format passes `post_load_transformed=True` (and gives its ReceiverAgent `load_weights=`): the planner then
never writes raw bytes into its tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from services.common.errors import FieldError
from services.weight_exchange.client.layout import POST_LOAD_TRANSFORMED, RECEIVER, RankLayout, Shard
from services.weight_exchange.client.layouts.inference import (
    ENGINES,
    InferenceParallel,
    inference_shards,
    logical_shape,
    receiver_views,
)
from services.weight_exchange.client.layouts.model import ModelSpec

__all__ = ["LayoutMismatch", "expert_ids_from_map", "live_layout", "receiver_views"]


class LayoutMismatch(ValueError):
    """The live parameters differ from the formula layout (missing / extra names, shapes)."""


def expert_ids_from_map(expert_map: Any, num_experts: int) -> tuple[int, ...]:
    """vLLM's `expert_map` (global expert -> local index, -1 when not held; a tensor or a sequence) -> the global
    experts held, in local order."""
    values = [int(x) for x in (expert_map.tolist() if hasattr(expert_map, "tolist") else expert_map)]
    if len(values) != num_experts:
        raise LayoutMismatch(f"expert_map: has {len(values)} entries, the model has {num_experts} experts")
    held = sorted((local, e) for e, local in enumerate(values) if local >= 0)
    if [local for local, _ in held] != list(range(len(held))):
        raise LayoutMismatch(f"expert_map: local indices {[local for local, _ in held]} are not 0..{len(held) - 1}")
    return tuple(e for _, e in held)


def _shape_dtype(value: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        return tuple(int(s) for s in value[0]), value[1]
    return tuple(int(s) for s in value.shape), str(value.dtype).removeprefix("torch.")


def live_layout(rank_id: str, params: Mapping[str, Any] | Iterable[tuple[str, Any]], spec: ModelSpec,
                engine: str = "vllm", *, tp: int = 1, tp_rank: int = 0, ep: int = 1, dp: int = 1, dp_rank: int = 0,
                edp: int = 1, edp_rank: int = 0, expert_map: Any = None,
                expert_ids: Sequence[int] | None = None, expert_placement: str = "linear",
                layers: tuple[int, int] | None = None, vocab_padding: int = 64,
                post_load_transformed: bool = False, ignore: Iterable[str] = (), agent_address: str = "",
                host: str = "", version: int = 0) -> RankLayout:
    """The receiver layout of one engine rank from its live parameters and parallel state.

    `params`: `model.named_parameters()` (a dict or the iterator; tensors, or (shape, dtype name) pairs).
    `expert_map`: vLLM's per-layer expert map (global -> local, -1: elsewhere), or `expert_ids` (the global experts
    held, in local order); neither: the engine's default placement. `layers`: the pipeline stage's global decoder
    layers [start, stop). `ignore`: live names the weight exchange does not update (e.g. buffers registered as
    parameters). Raises `LayoutMismatch` (a ValueError) listing every difference from the formula layout.
    """
    if engine not in ENGINES:
        raise FieldError("engine", f"unknown {engine!r} (known: {', '.join(ENGINES)})")
    held = {name: _shape_dtype(v) for name, v in (params.items() if isinstance(params, Mapping) else params)}
    names = {_formula_name(name): name for name in held}     # the formula's name -> the live one
    live = {formula_name: held[name] for formula_name, name in names.items()}
    if expert_map is not None:
        if expert_ids is not None:
            raise ValueError("expert_map / expert_ids: give one")
        expert_ids = expert_ids_from_map(expert_map, spec.num_experts)
    par = InferenceParallel(tp=tp, tp_rank=tp_rank, ep=ep, dp=dp, dp_rank=dp_rank, edp=edp, edp_rank=edp_rank,
                            engine=engine, vocab_padding=vocab_padding, expert_placement=expert_placement,
                            layers=tuple(layers) if layers is not None else None,  # type: ignore[arg-type]
                            expert_ids=tuple(expert_ids) if expert_ids is not None else None)
    formula = inference_shards(spec, par)
    declared: dict[str, tuple[int, ...]] = {}
    for s in formula:
        declared.setdefault(s.local_name, s.local_shape)
    skip = set(ignore)
    missing = sorted(n for n in declared if n not in live)
    extra = sorted(names[n] for n in live if n not in declared and names[n] not in skip)
    shapes = sorted(f"{n}: live {list(live[n][0])}, expected {list(_live_shape(engine, n, shape))}"
                    for n, shape in declared.items()
                    if n in live and logical_shape(engine, n, live[n][0]) != shape)
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"extra {extra}")
    if shapes:
        problems.append("shape differs: " + "; ".join(shapes))
    if problems:
        raise LayoutMismatch(f"{rank_id}: live parameters of {engine} (tp_rank {tp_rank}/{tp}, ep {ep}, edp_rank "
                             f"{edp_rank}/{edp}, layers {layers}) do not match the {spec.arch} layout: "
                             + "; ".join(problems))
    shards = [Shard(s.canonical_name, s.canonical_shape, live[s.local_name][1], s.canonical_region,
                    names[s.local_name], s.local_shape, s.local_region) for s in formula]
    parallel = par.as_dict()
    if layers is not None:
        parallel.update(layer_start=layers[0], layer_stop=layers[1])
    if post_load_transformed:
        parallel[POST_LOAD_TRANSFORMED] = 1
    layout = RankLayout(rank_id, RECEIVER, engine, shards, parallel, agent_address=agent_address, host=host,
                        version=version)
    return layout


def _formula_name(name: str) -> str:
    """A live parameter's name as the formula layouts write it. vLLM 0.3x keeps a FusedMoE layer's weights in
    its `routed_experts` child (`mlp.experts.routed_experts.w13_weight`); earlier versions, vLLM-Ascend and the
    formula hold them on the layer itself (`mlp.experts.w13_weight`)."""
    return name.replace(".experts.routed_experts.", ".experts.")


def _live_shape(engine: str, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The live (physical) shape of a tensor the layout declares in `shape` (its inverse of `logical_shape`)."""
    return logical_shape(engine, name, shape)   # a transpose of the last two dims is its own inverse
