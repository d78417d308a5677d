"""Offline objectives: DPO / IPO on preference pairs and the SFT loss."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .aggregation import AggMode, aggregate, masked_sum

DPOLossType = Literal["sigmoid", "ipo"]


def sequence_logp(logp: torch.Tensor, loss_mask: torch.Tensor, *, mean: bool = False) -> torch.Tensor:
    """Sum (``mean``: mean) of the trained tokens' log-probs per row, float[B]; an empty row gives 0."""
    total = masked_sum(logp, loss_mask, dim=-1)
    return total / loss_mask.bool().sum(-1).clamp(min=1) if mean else total


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: DPOLossType = "sigmoid",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Preference loss on sequence log-probs float[P] of P pairs, averaged over pairs.

    h = (pi_c - pi_r) - (ref_c - ref_r);  DPO: -log sigmoid(beta * h);  IPO: (h - 1/(2*beta))^2.
    IPO expects length-normalised log-probs (``sequence_logp(..., mean=True)``, as TRL and AReaL do):
    with sums the fixed target margin 1/(2*beta) means something different for every length.
    """
    h = (policy_chosen - policy_rejected) - (ref_chosen.detach() - ref_rejected.detach())
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"dpo loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}")
    with torch.no_grad():
        stats = {
            "dpo_margin": float((beta * h).mean()),
            "dpo_accuracy": float((h > 0).float().mean()),
            "dpo_chosen_reward": float((beta * (policy_chosen - ref_chosen)).mean()),
            "dpo_rejected_reward": float((beta * (policy_rejected - ref_rejected)).mean()),
        }
    return losses.mean(), stats


def sft_loss(logp: torch.Tensor, loss_mask: torch.Tensor, mode: AggMode = "token_mean") -> torch.Tensor:
    """Negative log-likelihood of the trained tokens."""
    return -aggregate(logp, loss_mask, mode)
