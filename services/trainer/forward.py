"""Model forwards on packed batches: logits, per-token log-probs, no-grad evaluation. Torch only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from services.trainer.algorithms import token_logp
from services.trainer.batching import PackedBatch


def sequence_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """float[B, L-1, V]: position t predicts token t+1."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, :-1, :]


def policy_logp(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    return token_logp(sequence_logits(model, batch), batch.input_ids[:, 1:], temperature)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """No grad and eval mode (no dropout) for the duration; the previous mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def frozen_logp(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    """Per-token log-probs with no grad and no dropout, float[B, L-1]."""
    with evaluating(model):
        return policy_logp(model, batch, temperature)
