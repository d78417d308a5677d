"""Training batch (protobuf) -> padded tensors aligned on next-token positions. No I/O.

Row i holds prompt + completion, right-padded to L tokens. Position t of the [B, L-1] grids is the
prediction of token t+1, so completion token j of row i sits at column len(prompt_i) - 1 + j.
"""

from __future__ import annotations

import dataclasses

import torch

from services.common.contracts import data_pb2


@dataclasses.dataclass
class PackedBatch:
    input_ids: torch.Tensor      # long[B, L]
    attention_mask: torch.Tensor  # long[B, L]
    loss_mask: torch.Tensor      # float[B, L-1]
    behav_logp: torch.Tensor     # float[B, L-1]
    versions: torch.Tensor       # long[B, L-1], -1 off the completion
    rewards: torch.Tensor        # float[B]
    group_ids: torch.Tensor      # long[B]
    lengths: torch.Tensor        # long[B], completion tokens per row
    truncated: torch.Tensor      # bool[B], generation stopped at max_new_tokens (finish_reason "length")

    def rows(self, index: torch.Tensor) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def pack(trajectories: list[data_pb2.Trajectory], pad_token_id: int) -> PackedBatch:
    if not trajectories:
        raise ValueError("trajectories: empty batch")
    for t in trajectories:
        n = len(t.completion_ids)
        if not t.prompt_ids:
            raise ValueError(f"prompt_ids: empty in trajectory {t.trajectory_id}")
        for field in ("behavior_logprobs", "versions", "loss_mask"):
            if len(getattr(t, field)) != n:
                raise ValueError(f"{field}: {len(getattr(t, field))} entries for {n} tokens in {t.trajectory_id}")
    width = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    b = len(trajectories)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1))
    behav = torch.zeros((b, width - 1))
    versions = torch.full((b, width - 1), -1, dtype=torch.long)
    group_index: dict[str, int] = {}
    groups = []
    for i, t in enumerate(trajectories):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        input_ids[i, : p + c] = torch.tensor(list(t.prompt_ids) + list(t.completion_ids))
        attention[i, : p + c] = 1
        if c:
            cols = slice(p - 1, p - 1 + c)
            loss_mask[i, cols] = torch.tensor(list(t.loss_mask), dtype=torch.float)
            behav[i, cols] = torch.tensor(list(t.behavior_logprobs))
            versions[i, cols] = torch.tensor(list(t.versions))
        groups.append(group_index.setdefault(t.group_id, len(group_index)))
    return PackedBatch(input_ids, attention, loss_mask, behav, versions,
                       torch.tensor([t.reward for t in trajectories], dtype=torch.float),
                       torch.tensor(groups, dtype=torch.long),
                       torch.tensor([len(t.completion_ids) for t in trajectories], dtype=torch.long),
                       torch.tensor([t.finish_reason == "length" for t in trajectories], dtype=torch.bool))


def trajectory_staleness(t: data_pb2.Trajectory, train_version: int) -> int:
    generated = [v for v in t.versions if v >= 0]
    return train_version - min(generated) if generated else 0


def distinct_versions(t: data_pb2.Trajectory) -> int:
    return len({v for v in t.versions if v >= 0})


def batch_staleness(versions: torch.Tensor, train_version: int) -> dict[str, float]:
    """Histogram of trajectory staleness in a packed batch: ``staleness_hist_<s>`` = rows that are s versions
    old (by their oldest generated token), plus mean and max."""
    generated = versions >= 0
    oldest = torch.where(generated, versions, train_version).min(-1).values
    stale = (train_version - oldest).clamp(min=0)
    values, counts = torch.unique(stale, return_counts=True)
    out = {f"staleness_hist_{int(v)}": float(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}
    out["staleness_traj_mean"] = float(stale.float().mean()) if stale.numel() else 0.0
    out["staleness_traj_max"] = float(stale.max()) if stale.numel() else 0.0
    return out
