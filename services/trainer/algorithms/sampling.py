"""Dynamic sampling (DAPO): drop prompt groups that carry no learning signal."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class GroupFilter:
    keep: torch.Tensor  # bool[B]
    num_groups: int
    num_groups_dropped: int
    num_samples_dropped: int

    def stats(self) -> dict[str, float]:
        return {
            "groups_total": float(self.num_groups),
            "groups_dropped": float(self.num_groups_dropped),
            "samples_dropped": float(self.num_samples_dropped),
        }


def filter_uniform_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupFilter:
    """Keep only samples whose group has at least two distinct rewards (all-equal groups have zero
    group-relative advantage). A group of one sample is dropped too."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.float()
    high = torch.full((num_groups,), -torch.inf, device=r.device).scatter_reduce(0, inverse, r, "amax")
    low = torch.full((num_groups,), torch.inf, device=r.device).scatter_reduce(0, inverse, r, "amin")
    varied = high > low
    keep = varied[inverse]
    return GroupFilter(keep, num_groups, int((~varied).sum()), int((~keep).sum()))
