"""Data-parallel rows: which rows of a batch this rank trains, how its loss is weighted, and the reductions
that make N ranks take the step one process would take on the whole batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from services.trainer.batching import PackedBatch


class RowShards:
    """Every rank holds the whole batch; rank r trains the r-th contiguous share of each minibatch."""

    def __init__(self, rank: int, world: int, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world, self.device, self.group = rank, world, device, group

    def split(self, part: torch.Tensor, loss_mask: torch.Tensor, weight_of: Callable[[torch.Tensor], int]
              ) -> tuple[torch.Tensor, float, float]:
        """(rows, loss scale, loss weight) of this rank's share of minibatch ``part``. The gradients are averaged
        over the ranks, so rank r's loss is scaled by world * w_r / sum(w): the sum is the whole minibatch's loss.
        A rank with no rows still runs the forward and backward (the shards' collectives need every rank) on one
        row, scaled by 0."""
        mine = torch.tensor_split(part, self.world)[self.rank]
        if mine.numel() == 0:
            return part[:1], 0.0, 0.0
        total = weight_of(loss_mask[part])
        weight = weight_of(loss_mask[mine])
        return mine, self.world * weight / max(total, 1), float(weight)

    def gather_rows(self, fn: Callable[[PackedBatch], torch.Tensor], batch: PackedBatch) -> torch.Tensor:
        """``fn(batch)`` (a per-row tensor, e.g. no-grad log-probs) computed on this rank's share of the rows and
        gathered from every rank, so each rank computes 1/world of it."""
        shares = torch.tensor_split(torch.arange(batch.size), self.world)
        mine = shares[self.rank]
        out = fn(batch.rows(mine if mine.numel() else torch.arange(1)))
        height = max(s.numel() for s in shares)
        padded = out.new_zeros((height, *out.shape[1:]))
        padded[:mine.numel()] = out[:mine.numel()]
        gathered = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(gathered, padded.contiguous(), group=self.group)
        return torch.cat([g[:s.numel()] for g, s in zip(gathered, shares, strict=True)])

    def all_finite(self, loss: torch.Tensor) -> bool:
        """Every rank's loss is finite (all ranks skip an update together or none does)."""
        flag = torch.tensor([float(torch.isfinite(loss.detach()))], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item() == 1.0)

    def mean_stats(self, stats: dict[str, float], weight: float) -> dict[str, float]:
        """Per-update stats over all ranks: ``*_max`` by max, the rest weighted by each rank's loss weight (so
        ``loss`` is the whole minibatch's)."""
        keys = sorted(stats)
        means = [k for k in keys if not k.endswith("_max")]
        maxima = [k for k in keys if k.endswith("_max")]
        sums = torch.tensor([weight * stats[k] for k in means] + [weight], dtype=torch.float64, device=self.device)
        top = torch.tensor([stats[k] for k in maxima] + [0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        total = max(float(sums[-1]), 1e-12)
        out = {k: float(v) / total for k, v in zip(means, sums[:-1].tolist(), strict=True)}
        out.update(zip(maxima, top[:-1].tolist(), strict=True))
        return out
