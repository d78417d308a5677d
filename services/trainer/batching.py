"""Training batch (protobuf) -> padded tensors aligned on next-token positions. No I/O.

Row i holds prompt + completion, right-padded to L tokens. Position t of the [B, L-1] grids is the
prediction of token t+1, so completion token j of row i sits at column len(prompt_i) - 1 + j.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.logging import get_logger
from services.common.routed_experts import check
from services.common.sampling import temperature_mismatch
from services.common.staleness import staleness
from services.common.steps import check_step_rewards


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
    step_rewards: torch.Tensor   # float[B, L-1], each process reward on the last token of its step, 0 elsewhere
    step_mask: torch.Tensor      # bool[B, L-1], True where a step ends (rows without process rewards: none)
    # MoE routing replay: int16[B, L, layers, top_k], the experts the rollout routed each input token to (-1: not
    # recorded, the model routes it); int16[B, 0, 0, 0] when no trajectory of the batch carries routes
    routes: torch.Tensor
    # a vision-language batch: each row's prompt images as pixels float[B, M, C, H, W] (M: the most images of a
    # row; float[B, 0, 0, 0, 0] for a text batch), how many of a row's M are real, and an id per distinct image set
    # (0: none), so packing shares a prompt only between rows with the same tokens and the same images
    pixels: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, 0, 0, 0, 0))
    image_count: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    image_group: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """Every row's images in row order, float[images, C, H, W] (the order of their placeholders in the
        flattened input ids); None for a text batch."""
        if self.pixels.shape[1] == 0:
            return None
        real = torch.arange(self.pixels.shape[1], device=self.pixels.device) < self.image_count.unsqueeze(-1)
        return self.pixels[real]

    def rows(self, index: torch.Tensor) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


def nonfinite_reward(t: data_pb2.Trajectory) -> str | None:
    """The field of `t` that holds a non-finite reward (outcome or process), or None."""
    if not math.isfinite(t.reward):
        return "reward"
    return next((f"step_rewards[{k}].reward" for k, s in enumerate(t.step_rewards) if not math.isfinite(s.reward)),
                None)


def finite_reward_groups(trajectories: list[data_pb2.Trajectory]) -> tuple[list[data_pb2.Trajectory], dict[str, str]]:
    """The trajectories of the groups whose rewards are all finite, and why each other group is left out.

    One non-finite reward (an agent's value past float32 arrives as inf) makes its group's advantages NaN, and every
    minibatch holding one of its rows then skips its update: usually the whole step. Only that group is left out.
    """
    bad: dict[str, str] = {}
    for t in trajectories:
        if t.group_id not in bad and (field := nonfinite_reward(t)) is not None:
            bad[t.group_id] = f"{field}: not finite in {t.trajectory_id}"
    return [t for t in trajectories if t.group_id not in bad], bad


def pack(trajectories: list[data_pb2.Trajectory], pad_token_id: int, *,
         temperature: float | None = None, pixels: Mapping[str, torch.Tensor] | None = None) -> PackedBatch:
    """The batch as tensors; ValueError naming the field for one the trainer cannot train on (`temperature`: the
    one it computes log-probs at; a trajectory sampled at another is refused, see services.common.sampling).
    `pixels`: each image the trajectories name, by digest, as float[C, H, W]."""
    if not trajectories:
        raise FieldError("trajectories", "empty batch")
    if temperature is not None:
        mismatch = next(filter(None, (temperature_mismatch(t, temperature) for t in trajectories)), "")
        if mismatch:
            raise ValueError(mismatch)
    trajectories, rejected = finite_reward_groups(trajectories)
    if not trajectories:
        raise ValueError(f"{next(iter(rejected.values()))}; every group of the batch has a non-finite reward "
                         f"({', '.join(rejected)})")
    if rejected:  # the batch's other groups still train
        get_logger().warning("batch_groups_rejected", groups=rejected)
    for t in trajectories:
        n = len(t.completion_ids)
        if not t.prompt_ids:
            raise FieldError("prompt_ids", f"empty in trajectory {t.trajectory_id}")
        for field in ("behavior_logprobs", "versions", "loss_mask"):
            if len(getattr(t, field)) != n:
                raise FieldError(field, f"{len(getattr(t, field))} entries for {n} tokens in {t.trajectory_id}")
        try:
            check_step_rewards(t)
        except ValueError as exc:
            raise ValueError(f"{exc} in {t.trajectory_id}") from None
    width = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    # rows built as Python lists and turned into tensors once per field: one torch.tensor call per row and
    # field cost ~0.3 s for 512 rows
    input_ids, attention, loss_mask, behav, versions = [], [], [], [], []
    group_index: dict[str, int] = {}
    groups = []
    for t in trajectories:
        p, c = len(t.prompt_ids), len(t.completion_ids)
        pad = width - p - c
        input_ids.append([*t.prompt_ids, *t.completion_ids] + [pad_token_id] * pad)
        attention.append([1] * (p + c) + [0] * pad)
        before, after = [0.0] * (p - 1), [0.0] * pad  # next-token grid: completion token j sits at p - 1 + j
        loss_mask.append([*before, *t.loss_mask, *after])
        behav.append([*before, *t.behavior_logprobs, *after])
        versions.append([-1] * (p - 1) + list(t.versions) + [-1] * pad)
        groups.append(group_index.setdefault(t.group_id, len(group_index)))
    step_rows, step_cols, step_values = [], [], []
    for row, t in enumerate(trajectories):
        for step in t.step_rewards:  # completion token end - 1 predicted at column len(prompt) - 1 + end - 1
            step_rows.append(row)
            step_cols.append(len(t.prompt_ids) + step.end - 2)
            step_values.append(step.reward)
    step_rewards = torch.zeros(len(trajectories), width - 1)
    step_rewards[step_rows, step_cols] = torch.tensor(step_values, dtype=torch.float)
    step_mask = torch.zeros(len(trajectories), width - 1, dtype=torch.bool)
    step_mask[step_rows, step_cols] = True
    return PackedBatch(torch.tensor(input_ids, dtype=torch.long), torch.tensor(attention, dtype=torch.long),
                       torch.tensor(loss_mask, dtype=torch.float), torch.tensor(behav, dtype=torch.float),
                       torch.tensor(versions, dtype=torch.long),
                       torch.tensor([t.reward for t in trajectories], dtype=torch.float),
                       torch.tensor(groups, dtype=torch.long),
                       torch.tensor([len(t.completion_ids) for t in trajectories], dtype=torch.long),
                       torch.tensor([t.finish_reason == "length" for t in trajectories], dtype=torch.bool),
                       step_rewards, step_mask, routed_experts(trajectories, width),
                       *row_images(trajectories, pixels or {}))


def row_images(trajectories: list[data_pb2.Trajectory], pixels: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixels, image_count, image_group) of PackedBatch for these rows; ValueError naming the field for an image
    whose pixels are missing."""
    most = max(len(t.images) for t in trajectories)
    count = torch.tensor([len(t.images) for t in trajectories], dtype=torch.long)
    if most == 0:
        return torch.zeros(len(trajectories), 0, 0, 0, 0), count, torch.zeros(len(trajectories), dtype=torch.long)
    missing = next((t for t in trajectories for ref in t.images if ref.sha256 not in pixels), None)
    if missing is not None:
        raise FieldError("images", f"trajectory {missing.trajectory_id} names an image with no pixels here")
    shape = next(iter(pixels.values())).shape
    out = torch.zeros(len(trajectories), most, *shape)
    groups: dict[tuple[str, ...], int] = {(): 0}
    group = []
    for row, t in enumerate(trajectories):
        for k, ref in enumerate(t.images):
            if pixels[ref.sha256].shape != shape:
                raise FieldError("images", f"trajectory {t.trajectory_id}: image {k} is {tuple(pixels[ref.sha256].shape)}"
                                 f" pixels, the batch's others {tuple(shape)}")
            out[row, k] = pixels[ref.sha256]
        group.append(groups.setdefault(tuple(ref.sha256 for ref in t.images), len(groups)))
    return out, count, torch.tensor(group, dtype=torch.long)


def routed_experts(trajectories: list[data_pb2.Trajectory], width: int) -> torch.Tensor:
    """The batch's recorded routes on the [B, L] token grid (see PackedBatch.routes); ValueError naming the field
    for routes longer than their trajectory or shaped unlike the batch's others."""
    recorded = []
    for row, t in enumerate(trajectories):
        try:
            routes = check(t)
        except ValueError as exc:
            raise ValueError(f"{exc} in {t.trajectory_id}") from None
        if routes is not None:
            recorded.append((row, t, routes))
    if not recorded:
        return torch.zeros((len(trajectories), 0, 0, 0), dtype=torch.int16)
    shape = recorded[0][2].shape[1:]
    out = torch.full((len(trajectories), width, *shape), -1, dtype=torch.int16)
    for row, t, routes in recorded:
        if routes.shape[1:] != shape:
            raise FieldError("routed_experts", f"{routes.shape[1]} layers x top-{routes.shape[2]} in "
                                               f"{t.trajectory_id}, {shape[0]} x top-{shape[1]} in the batch's others")
        out[row, :len(routes)] = torch.from_numpy(routes.astype("int16"))
    return out


def trajectory_staleness(t: data_pb2.Trajectory, train_version: int) -> int:
    return staleness(t.versions, train_version)


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
