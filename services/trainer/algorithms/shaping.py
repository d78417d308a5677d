"""Reward shaping: bias/scale/clip, the DAPO overlong penalty, and KL-to-reference penalties."""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS = ("k1", "k2", "k3")


def shape_rewards(
    rewards: torch.Tensor, *, bias: float = 0.0, scale: float = 1.0, clip: float | None = None
) -> torch.Tensor:
    """r' = clip((r + bias) * scale, -clip, clip)."""
    shaped = (rewards.float() + bias) * scale
    return shaped if clip is None else shaped.clamp(-clip, clip)


def overlong_penalty(
    lengths: torch.Tensor, *, max_new_tokens: int, overlong_tokens: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, float[B] (0 or negative).

    Zero up to ``max_new_tokens - overlong_tokens`` tokens, then falls linearly to ``-factor`` at
    ``max_new_tokens``: ``min(-(len - (L_max - L_cache)) / L_cache * factor, 0)``.
    """
    assert 0 < overlong_tokens <= max_new_tokens, (overlong_tokens, max_new_tokens)
    exceed = lengths.float() - (max_new_tokens - overlong_tokens)
    return (-exceed / overlong_tokens * factor).clamp(max=0.0)


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k1", *, clamp: float | None = 10.0
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with log r = logp - ref_logp.

    k1 = log r;  k2 = (log r)^2 / 2;  k3 = exp(-log r) - 1 + log r  (unbiased and >= 0).
    """
    log_r = logp - ref_logp
    if estimator == "k1":
        kl = log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.exp(-log_r) - 1 + log_r
    else:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_reward_penalty(
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl_ctl: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """Per-token reward ``-kl_ctl * KL_est(old, ref)``, zero outside the loss mask (float[B, T])."""
    kl = kl_estimate(old_logp.detach().float(), ref_logp.detach().float(), estimator)
    return torch.where(loss_mask.bool(), -kl_ctl * kl, 0.0)
