"""Reducing a per-token loss float[B, T] over the loss mask to a scalar."""

from __future__ import annotations

from typing import Literal

import torch

AggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    masked = torch.where(mask.bool(), values, 0.0)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def num_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Rows with at least one trained token (rows with none are not sequences of this batch)."""
    return mask.bool().any(-1).sum().clamp(min=1)


def aggregate(
    values: torch.Tensor, loss_mask: torch.Tensor, mode: AggMode = "token_mean", *, norm_constant: int | None = None
) -> torch.Tensor:
    """Reduce float[B, T] to a scalar; positions where ``loss_mask`` is 0 never contribute.

    - ``token_mean``: sum over all trained tokens / number of trained tokens.
    - ``seq_mean_token_mean``: mean over sequences of each sequence's token mean.
    - ``seq_mean_token_sum``: mean over sequences of each sequence's token sum.
    - ``seq_mean_token_sum_norm`` (Dr.GRPO): sum over all tokens / (num sequences * C), with the
      constant C = ``norm_constant`` (e.g. max_new_tokens), or the padded length T when not given.
    """
    mask = loss_mask.bool()
    if mode == "token_mean":
        return masked_mean(values, mask)
    if mode == "seq_mean_token_mean":
        return masked_mean(values, mask, dim=-1).sum() / num_sequences(mask)
    if mode == "seq_mean_token_sum":
        return masked_sum(values, mask, dim=-1).sum() / num_sequences(mask)
    if mode == "seq_mean_token_sum_norm":
        constant = norm_constant if norm_constant is not None else mask.shape[-1]
        return masked_sum(values, mask) / (num_sequences(mask) * constant)
    raise ValueError(f"aggregation mode must be one of {AGG_MODES}, got {mode!r}")


def loss_weight(loss_mask: torch.Tensor, mode: AggMode = "token_mean") -> int:
    """Weight of this (micro-)batch when averaging aggregated losses across micro-batches or ranks.

    ``token_mean`` averages over tokens, so the weight is the trained-token count; the other modes
    average over sequences, so it is the number of sequences.
    """
    mask = loss_mask.bool()
    return int(mask.sum()) if mode == "token_mean" else int(mask.any(-1).sum())
