"""Temperature / top-k / top-p sampling with the log-prob of each chosen token."""

from __future__ import annotations

import torch

from services.rollout.engines.sequence import MIN_TEMPERATURE


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V]; per-row temperature / top_p / top_k [B]. Returns (tokens [B], logprobs [B]).

    The log-prob is taken under softmax(logits / T) before top-k / top-p truncation (T = 1 for greedy
    rows), which is the distribution the trainer recomputes. A temperature in (0, MIN_TEMPERATURE) samples as at
    MIN_TEMPERATURE: dividing by a smaller one overflows float32 and would poison the whole batch.
    """
    logits = logits.float()
    greedy = temperature <= 0
    safe = torch.where(greedy, torch.ones_like(temperature), temperature.clamp(min=MIN_TEMPERATURE))
    scaled = logits / safe.unsqueeze(-1)
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    filtered = _top_k_top_p(scaled, top_p, top_k)
    sampled = _inverse_cdf(torch.softmax(filtered, dim=-1), generator)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row drawn from `probs` [B, V] by inverting its CDF with one uniform per row: the same
    distribution as torch.multinomial, ~15x cheaper on CPU for a few hundred rows. A token of probability 0
    is never drawn (the first index whose CDF exceeds u has positive mass)."""
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _top_k_top_p(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    if bool((top_p >= 1).all()) and bool((top_k <= 0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1])).unsqueeze(-1)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop = (ranks >= k) | (mass_before >= top_p.unsqueeze(-1))
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
