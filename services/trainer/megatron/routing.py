"""MoE routing replay for megatron-core routers: each `TopKRouter` takes the rollout's recorded experts for the
tokens it routes, through its `router_replay` hook (megatron-core's `topk_routing_with_score_function` asks that
object for the top-k: `get_replay_topk(scores, topk, num_groups, group_topk, default)`).

megatron-core's own `RouterReplay` replays every token; here a token without a record (-1: padding, a
trajectory's last token, a gateway turn) keeps the router's own choice, as the transformers replay does
(`services.common.moe_routing`). `MegatronCausalLM.forward` lays the targets out as its routers see the tokens:
sequence-major ([s, b] flattened), padded to the forward's shape, and with sequence parallelism this tensor-
parallel rank's slice of the sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from services.common.moe_routing import ReplayCounts, replayed_indices


class MegatronRoutes(ReplayCounts):
    """The replay interface `services.trainer.forward` uses (`replay(targets)`, `take_stats()`), for the routers of
    one megatron-core GPTModel holding every layer (no pipeline stages)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = sorted((m for m in gpt.modules() if isinstance(m, TopKRouter)), key=lambda m: m.layer_number)
        if not routers:
            raise ValueError("routing_replay: the model has no MoE router")
        self.top_k = routers[0].topk
        self.layers = len(routers)
        for index, router in enumerate(routers):
            router.router_replay = _LayerReplay(self, index)
        self.targets: torch.Tensor | None = None  # [b * s, layers, top_k] as the trainer's rows hold them
        self.local: torch.Tensor | None = None    # ... as this rank's routers see them (MegatronCausalLM.forward)

    @contextlib.contextmanager
    def replay(self, targets: torch.Tensor) -> Iterator[None]:
        self.check_targets(targets)
        self.targets = targets
        try:
            yield
        finally:
            self.targets = self.local = None

    def lay_out(self, rows: int, width: int, shape: list[int], sequence_parallel: tuple[int, int] | None) -> None:
        """Targets for a forward of `rows` x `width` tokens run as `shape` (padded): sequence-major, and with
        `sequence_parallel` = (tp rank, tp size) that rank's contiguous slice of the sequence."""
        if self.targets is None:
            self.local = None
            return
        grid = self.targets.new_full((shape[0], shape[1], self.layers, self.top_k), -1)
        grid[:rows, :width] = self.targets.view(rows, width, self.layers, self.top_k)
        grid = grid.transpose(0, 1)  # [s, b, ...]
        if sequence_parallel is not None:
            rank, size = sequence_parallel
            chunk = shape[1] // size
            grid = grid[rank * chunk:(rank + 1) * chunk]
        self.local = grid.reshape(-1, self.layers, self.top_k)


class _LayerReplay:
    def __init__(self, routes: MegatronRoutes, layer: int) -> None:
        self.routes, self.layer = routes, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        local = self.routes.local
        if local is None:
            return own
        indices = replayed_indices(own[1], local[:, self.layer], self.routes)
        return scores.gather(1, indices), indices
