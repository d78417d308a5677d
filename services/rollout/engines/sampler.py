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
    if bool((greedy | (temperature == 1)).all()):
        scaled = logits  # T = 1 for every row: no division pass over the vocabulary
    else:
        safe = torch.where(greedy, torch.ones_like(temperature), temperature.clamp(min=MIN_TEMPERATURE))
        scaled = logits / safe.unsqueeze(-1)
    if bool(greedy.all()):  # nothing to draw
        tokens = logits.argmax(-1)
        return tokens, scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    filtered = _top_k_top_p(scaled, top_p, top_k)
    if filtered is scaled:
        # untruncated: one exp pass serves both the draw (an unnormalised CDF) and the log-normaliser
        peak = scaled.amax(-1, keepdim=True)
        cdf = (scaled - peak).exp_().cumsum_(-1)
        sampled = _draw(cdf, generator)
        log_norm = peak.squeeze(-1) + cdf[:, -1].log()
    else:
        sampled = _inverse_cdf(torch.softmax(filtered, dim=-1), generator)
        log_norm = torch.logsumexp(scaled, dim=-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled) if bool(greedy.any()) else sampled
    return tokens, scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row drawn from `probs` [B, V] by inverting its CDF with one uniform per row: the same
    distribution as torch.multinomial, ~15x cheaper on CPU for a few hundred rows. A token of probability 0
    is never drawn (the first index whose CDF exceeds u has positive mass)."""
    return _draw(probs.cumsum(-1), generator)


def _draw(cdf: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of a (not necessarily normalised) CDF [B, V], by one uniform per row."""
    u = torch.rand((cdf.shape[0], 1), generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


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
