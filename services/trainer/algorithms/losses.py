"""Per-token policy and value losses. ``old_logp`` is the trust-region centre (pi_prox or pi_behav).

Each policy loss returns a ``TokenLoss`` whose ``loss`` is float[B, T] (to be multiplied by the
behaviour weight and reduced by ``aggregation.aggregate``); positions outside the loss mask are 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aggregation import AggMode, aggregate, masked_mean
from .offpolicy import behaviour_weights


@dataclass(slots=True)
class TokenLoss:
    loss: torch.Tensor  # float[B, T]
    ratio: torch.Tensor  # float[B, T] (no grad): the importance ratio the objective used
    clipped: torch.Tensor  # bool[B, T]: tokens whose ratio the clip (or CISPO's weight clip) acted on
    dual_clipped: torch.Tensor  # bool[B, T]: tokens capped by the dual clip


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Masked positions get log ratio 0 (and advantage 0, see _adv) so that whatever the trainer left
    # there (padding, NaN) can never reach the loss or produce inf/NaN gradients.
    return torch.where(mask, logp - old_logp.detach(), 0.0)


def _adv(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, advantages.detach(), 0.0)


def _clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float | None,
    eps_clip_higher: float | None,
    c_clip: float | None,
) -> TokenLoss:
    """max(-A*u, -A*clip(u, 1-eps, 1+eps_higher)), optionally capped at c_clip*|A| (dual clip)."""
    unclipped = -adv * ratio
    none = torch.zeros_like(mask)
    if eps_clip is None:
        loss, clipped = unclipped, none
    else:
        high = eps_clip if eps_clip_higher is None else eps_clip_higher
        clipped_loss = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
        loss = torch.maximum(unclipped, clipped_loss)
        clipped = mask & (unclipped.detach() < clipped_loss.detach())
    dual = none
    if c_clip is not None:
        assert c_clip > 1.0, c_clip
        cap = c_clip * adv.abs()
        dual = mask & (cap < loss.detach())
        loss = torch.minimum(loss, cap)
    return TokenLoss(torch.where(mask, loss, 0.0), ratio.detach(), clipped, dual)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float | None = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
) -> TokenLoss:
    """Token-level PPO clip; ``eps_clip_higher`` is DAPO's clip-higher; ``eps_clip=None`` = no clip."""
    mask = loss_mask.bool()
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))
    return _clipped_surrogate(ratio, _adv(advantages, mask), mask, eps_clip, eps_clip_higher, c_clip)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float | None = 3e-4,
    eps_clip_higher: float | None = 4e-4,
    c_clip: float | None = None,
) -> TokenLoss:
    """GSPO: sequence ratio s_i = exp(mean_t(logp - old_logp)) and the row's mean advantage, clipped
    like PPO (``c_clip``: the dual clip on the sequence surrogate); every trained token of a row carries
    the row's loss (aggregate with a seq-mean mode)."""
    mask = loss_mask.bool()
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_ratio = torch.exp(_log_ratio(logp, old_logp, mask).sum(-1, keepdim=True) / count)
    seq_adv = _adv(advantages, mask).sum(-1, keepdim=True) / count
    shape = mask.shape
    return _clipped_surrogate(seq_ratio.expand(shape), seq_adv.expand(shape), mask, eps_clip, eps_clip_higher, c_clip)


def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> TokenLoss:
    """SAPO soft gate: L = -g*A with g = (4/tau) * sigmoid(tau * (r - 1)), tau = tau_pos if A > 0 else tau_neg.

    At r = 1 the gradient equals the policy gradient -A * grad(log pi); it decays smoothly as r leaves 1.
    """
    mask = loss_mask.bool()
    adv = _adv(advantages, mask)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask))
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    none = torch.zeros_like(mask)
    return TokenLoss(torch.where(mask, -gate * adv, 0.0), ratio.detach(), none, none)


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float | None = 1.0,
    eps_clip_higher: float | None = 0.28,
) -> TokenLoss:
    """CISPO: L = -sg(clip(r, 1-eps, 1+eps_higher)) * A * log pi_theta; every token keeps a gradient."""
    mask = loss_mask.bool()
    ratio = torch.exp(_log_ratio(logp, old_logp, mask)).detach()
    weight, clipped = ratio, torch.zeros_like(mask)
    if eps_clip is not None:
        high = eps_clip if eps_clip_higher is None else eps_clip_higher
        weight = ratio.clamp(1.0 - eps_clip, 1.0 + high)
        clipped = mask & (weight != ratio)
    loss = torch.where(mask, -weight * _adv(advantages, mask) * torch.where(mask, logp, 0.0), 0.0)
    return TokenLoss(loss, ratio, clipped, torch.zeros_like(mask))


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float | None = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_cap: float | None = 5.0,
    agg: AggMode = "token_mean",
) -> torch.Tensor:
    """Decoupled PPO (areal.md §1.6): -w * min(u*A, clip(u)*A), u = pi/pi_prox, w = pi_prox/pi_behav.

    Tokens with w > cap are dropped; they still count in the token-mean denominator.
    """
    bw = behaviour_weights(prox_logp, behav_logp, loss_mask, cap=behav_imp_weight_cap)
    terms = ppo_clip_loss(
        logp, prox_logp, advantages, bw.mask, eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip
    )
    return aggregate(terms.loss * bw.weight, loss_mask, agg)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float | None = 0.5,
    loss_type: str = "mse",
    huber_delta: float = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped critic loss: max(f(V, R), f(V_old + clip(V - V_old, -eps, eps), R)), token-mean.

    f is 0.5 * (V - R)^2 (``mse``) or the Huber loss with ``huber_delta``.
    """

    def f(v: torch.Tensor) -> torch.Tensor:
        diff = (v - returns.detach()).abs()
        if loss_type == "mse":
            return 0.5 * diff.square()
        if loss_type == "huber":
            return torch.where(diff < huber_delta, 0.5 * diff.square(), huber_delta * (diff - 0.5 * huber_delta))
        raise ValueError(f"value loss_type must be 'mse' or 'huber', got {loss_type!r}")

    mask = loss_mask.bool()
    loss = f(values)
    clip_frac = 0.0
    if eps_clip is not None:
        old = old_values.detach()
        clipped = f(old + (values - old).clamp(-eps_clip, eps_clip))
        clip_frac = float(masked_mean((clipped > loss).float(), mask))
        loss = torch.maximum(loss, clipped)
    return masked_mean(loss, mask), {"value_clip_fraction": clip_frac}


def token_logp(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] per position, float[B, T]."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the next-token distribution per position, float[B, T]."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logprobs.exp() * logprobs).sum(-1)
