"""Advantage estimators: reward normalisation (GRPO family, RLOO), GAE, REINFORCE++ and whitening.

Sequence-level functions take ``rewards: float[B]`` and ``group_ids: long[B]`` (samples of the same
prompt share an id; groups need not be contiguous or equal-sized). Token-level functions take
``loss_mask: [B, T]`` and return float[B, T], zero where the mask is 0.
"""

from __future__ import annotations

from typing import Literal

import torch

NormLevel = Literal["group", "batch"] | None
NORM_LEVELS = ("group", "batch", None)


def _group_sums(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (sum of its group, size of its group) and the group index of each sample."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=x.dtype, device=x.device).index_add_(0, inverse, x)
    return sums[inverse], counts[inverse].to(x.dtype), inverse


def _std(x: torch.Tensor, group_ids: torch.Tensor | None, unbiased: bool) -> torch.Tensor:
    if group_ids is None:
        n = x.numel()
        var = (x - x.mean()).square().sum() / max(n - 1 if unbiased else n, 1)
        return var.sqrt().expand_as(x)
    sums, counts, inverse = _group_sums(x, group_ids)
    sq, _, _ = _group_sums((x - sums / counts).square(), group_ids)
    return (sq / (counts - 1 if unbiased else counts).clamp(min=1)).sqrt()


def normalize_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mean_level: NormLevel = "group",
    std_level: NormLevel = "group",
    leave_one_out: bool = False,
    unbiased: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """(r - baseline) / (std + eps), baseline and std taken per group, over the batch, or not at all.

    ``leave_one_out`` uses the mean of the *other* samples as the baseline (RLOO); a sample with no
    other sample at that level gets baseline = its own reward (advantage 0).
    """
    x = rewards.double()
    if mean_level is None:
        baseline = torch.zeros_like(x)
    else:
        if mean_level == "group":
            sums, counts, _ = _group_sums(x, group_ids)
        else:
            sums, counts = x.sum().expand_as(x), torch.full_like(x, x.numel())
        if leave_one_out:
            baseline = torch.where(counts > 1, (sums - x) / (counts - 1).clamp(min=1), x)
        else:
            baseline = sums / counts
    centred = x - baseline
    if std_level is not None:
        centred = centred / (_std(x, group_ids if std_level == "group" else None, unbiased) + eps)
    return centred.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
    """GRPO: (r - mean_group) / (std_group + eps), float[B]."""
    return normalize_rewards(rewards, group_ids, mean_level="group", std_level="group", eps=eps)


def drgrpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: r - mean_group (no std division), float[B]."""
    return normalize_rewards(rewards, group_ids, mean_level="group", std_level=None)


def liteppo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-5) -> torch.Tensor:
    """LitePPO: (r - mean_group) / (std_batch + eps), float[B]."""
    return normalize_rewards(rewards, group_ids, mean_level="group", std_level="batch", eps=eps)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean_{j != i in group} r_j, float[B]."""
    return normalize_rewards(rewards, group_ids, mean_level="group", std_level=None, leave_one_out=True)


def last_token_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool[B, T], True at the last trained position of each row (none for rows without one)."""
    mask = loss_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(-1, keepdim=True)
    return mask & (positions == last)


def token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence reward on its last trained token, float[B, T]."""
    return torch.where(last_token_mask(loss_mask), rewards.float().unsqueeze(-1), 0.0)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    loss_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens; returns (advantages, returns).

    The trained tokens of a row are the actions; untrained positions (prompt, padding, tool output)
    are skipped, so the recursion links each trained token to the next trained one:
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, with
    V = 0 after the last token. ``values=None`` means no critic (V = 0): A_t is then the discounted
    reward-to-go. Returns are A + V.
    """
    mask = loss_mask.bool()
    rewards = torch.where(mask, rewards.float(), 0.0)
    if values is None and gamma == 1.0 and lam == 1.0:
        adv = rewards.flip(-1).cumsum(-1).flip(-1)
        adv = torch.where(mask, adv, 0.0)
        return adv, adv
    values = torch.zeros_like(rewards) if values is None else torch.where(mask, values.detach().float(), 0.0)
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, 0.0)
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    return adv, torch.where(mask, adv + values, 0.0)


def whiten(
    x: torch.Tensor, loss_mask: torch.Tensor, *, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-5
) -> torch.Tensor:
    """Batch-level normalisation over trained tokens: (x - mean) / (std + eps), zero outside the mask."""
    mask = loss_mask.bool()
    n = mask.sum()
    mean = torch.where(mask, x, 0.0).sum() / n.clamp(min=1)
    var = torch.where(mask, (x - mean).square(), 0.0).sum() / (n - 1 if unbiased else n).clamp(min=1)
    out = ((x - mean) if shift_mean else x) / (var.sqrt() + eps)
    return torch.where(mask, out, 0.0)


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl_penalty: torch.Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-5,
) -> torch.Tensor:
    """REINFORCE++: per-token return of (KL penalty + final reward), whitened over the batch, float[B, T]."""
    tok = token_rewards(rewards, loss_mask)
    if kl_penalty is not None:
        tok = tok + kl_penalty
    returns, _ = gae(tok, None, loss_mask, gamma=gamma, lam=1.0)
    return whiten(returns, loss_mask, eps=eps)
