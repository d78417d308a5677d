"""Off-policy corrections for asynchronous training.

Three policies appear in the decoupled objective (areal.md §1.6): the behaviour policy that sampled
each token (``behav_logp``, per-token ``versions``), the proximal policy (the parameters before this
update, ``prox_logp``) and the current parameters (``logp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

WeightMode = Literal["mask", "clamp"]
WeightLevel = Literal["token", "sequence"]


def loglinear_prox_logp(
    behav_logp: torch.Tensor, logp: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """Approximate log pi_prox without a forward pass (AReaL ``prox_logp_method: loglinear``).

    log pi_prox ~= log pi_behav + alpha * (log pi_theta - log pi_behav),
    alpha = (v_prox - v_behav) / (v_theta - v_behav) with v_prox = ``current_version`` (the trainer's
    version before this step) and v_theta = v_prox + 1. Fresh tokens (v_behav = v_prox) get alpha = 0,
    i.e. pi_prox = pi_behav exactly; non-generated tokens (version -1) also get alpha = 0.
    """
    v_behav = versions.to(torch.float64)
    gap = current_version - v_behav
    alpha = torch.where((versions >= 0) & (gap >= 0), gap / (gap + 1), 0.0).to(behav_logp.dtype)
    return behav_logp + alpha * (logp.detach() - behav_logp)


WeightMetric = Literal["ratio", "binary_kl"]


def binary_kl(prox_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p) || Bernoulli(q)) per token, p = pi_prox(y_t), q = pi_behav(y_t): how far the two policies
    are apart on the partition {the sampled token, every other token} (KPop),

        p log(p / q) + (1 - p) log((1 - p) / (1 - q)).

    0 when p == q; small for a rare token whatever its ratio (the mass that moved is small); +inf where q is 0 or
    1 and p is not. No grad."""
    lp = prox_logp.detach().double().clamp(max=0.0)
    lq = behav_logp.detach().double().clamp(max=0.0)
    p = lp.exp()
    log_rest_p, log_rest_q = torch.log(-torch.expm1(lp)), torch.log(-torch.expm1(lq))   # log(1 - p), log(1 - q)
    rest = torch.where(p < 1, (1 - p) * (log_rest_p - log_rest_q), 0.0)
    return (p * (lp - lq) + rest).float()


@dataclass(slots=True)
class BehaviourWeights:
    weight: torch.Tensor  # float[B, T], no grad; 0 where a token is not trained
    mask: torch.Tensor  # bool[B, T], the loss mask after rejection
    affected_fraction: float  # fraction of trained tokens masked (mask mode) or clamped (clamp mode)


def behaviour_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    cap: float | None = 5.0,
    floor: float | None = None,
    mode: WeightMode = "mask",
    level: WeightLevel = "token",
    metric: WeightMetric = "ratio",
    kl_cap: float | None = None,
) -> BehaviourWeights:
    """Importance weight w = pi_prox / pi_behav (no grad) with a band [floor, cap].

    - ``level="token"``: one weight per token; ``"sequence"``: the geometric mean of the token
      weights of a row, shared by all its tokens (avoids the product's length blow-up).
    - ``mode="mask"``: tokens (or whole rows) whose weight leaves the band are dropped from the loss
      (rejection / IcePop-style two-sided masking when ``floor`` is set); ``"clamp"``: weights are
      clamped into the band and every token stays (truncated importance sampling).
    - ``metric="binary_kl"`` (KPop): what is masked is decided by ``binary_kl`` instead of the ratio: tokens
      whose binary KL exceeds ``kl_cap`` (``level="sequence"``: rows whose mean over their tokens does); the
      kept tokens keep their own w, unbounded (``cap`` / ``floor`` unused; mask mode only).
    """
    mask = loss_mask.bool()
    log_w = (prox_logp.detach() - behav_logp.detach()).float()
    log_w = torch.where(mask & torch.isfinite(log_w), log_w, 0.0)
    if metric == "binary_kl":
        assert mode == "mask" and kl_cap is not None, (mode, kl_cap)
        divergence = torch.where(mask, binary_kl(prox_logp, behav_logp), 0.0)
        if level == "sequence":
            divergence = (divergence.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_w)
        outside = mask & ~(divergence <= kl_cap)     # NaN (0 * inf) is outside too
        kept = mask & ~outside
        return BehaviourWeights(torch.where(kept, torch.exp(log_w), 0.0), kept,
                                int(outside.sum()) / max(int(mask.sum()), 1))
    if level == "sequence":
        log_w = (log_w.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_w)
    w = torch.exp(log_w)
    low = 0.0 if floor is None else floor
    high = float("inf") if cap is None else cap
    outside = mask & ((w < low) | (w > high))
    total = max(int(mask.sum()), 1)
    if mode == "mask":
        kept = mask & ~outside
        return BehaviourWeights(torch.where(kept, w, 0.0), kept, int(outside.sum()) / total)
    return BehaviourWeights(torch.where(mask, w.clamp(low, high), 0.0), mask, int(outside.sum()) / total)


def m2po_mask(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, loss_mask: torch.Tensor, *, threshold: float
) -> torch.Tensor:
    """M2PO second-moment masking, bool[B, T].

    With m2 = (log pi_behav - log pi_prox)^2 per trained token, drop the tokens with the largest m2,
    fewest first, until the mean m2 of the kept tokens is below ``threshold``. At least one token is
    always kept.
    """
    mask = loss_mask.bool()
    m2 = (behav_logp.detach() - prox_logp.detach()).float().square()
    selected = m2[mask]
    if selected.numel() == 0:
        return mask
    ordered, order = torch.sort(selected, descending=True)
    n = ordered.numel()
    suffix_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, device=m2.device)
    below = torch.nonzero(suffix_mean < threshold)
    num_dropped = int(below[0]) if below.numel() else n - 1
    keep_sorted = torch.arange(n, device=m2.device) >= num_dropped
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    out = torch.zeros_like(mask)
    out[mask] = keep
    return out


def staleness(versions: torch.Tensor, loss_mask: torch.Tensor, current_version: int) -> torch.Tensor:
    """current_version - version of each trained token, long[N] (N = trained tokens)."""
    mask = loss_mask.bool() & (versions >= 0)
    return current_version - versions[mask]


def staleness_histogram(versions: torch.Tensor, loss_mask: torch.Tensor, current_version: int) -> dict[int, int]:
    """{staleness in versions: number of trained tokens}."""
    values, counts = torch.unique(staleness(versions, loss_mask, current_version), return_counts=True)
    return {int(v): int(c) for v, c in zip(values.tolist(), counts.tolist(), strict=True)}
