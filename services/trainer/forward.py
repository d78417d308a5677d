"""Model forwards on training batches: logits, per-token log-probs, no-grad evaluation. Torch only.

Padded by default; inside ``packing.packed_forwards(PackingConfig(enabled=True))`` the rows are packed (no pad
tokens through the model) and the results put back on the same [B, L-1] grid. Packed, the log-prob functions
compute the vocabulary projection only where ``loss_mask`` is set (the only cells any objective reads) and
leave 0 elsewhere; ``sequence_logits`` fills every real position and leaves 0 past each row's end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from services.trainer.algorithms import token_logp
from services.trainer.batching import PackedBatch
from services.trainer.packing import active, pack_rows, packed_logits


def _packed_logits(model: torch.nn.Module, batch: PackedBatch, cells: torch.Tensor):
    """Logits float[N, V] of the grid cells where ``cells`` (bool[B, L-1]) is set, and those cells' (rows, cols)."""
    config = active()
    assert config is not None
    packing = pack_rows(batch.input_ids, batch.attention_mask, batch.lengths, config)
    rows, cols = torch.nonzero(cells, as_tuple=True)
    return packed_logits(model, packing, packing.locate(rows, cols)), rows, cols


def _on_grid(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    b, width = batch.input_ids.shape
    return values.new_zeros((b, width - 1, *values.shape[1:])).index_put((rows, cols), values)


def _trained_cells(batch: PackedBatch) -> torch.Tensor:
    return (batch.loss_mask != 0) & batch.attention_mask[:, 1:].bool()


def sequence_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """float[B, L-1, V]: position t predicts token t+1."""
    if active() is not None:
        logits, rows, cols = _packed_logits(model, batch, batch.attention_mask[:, 1:].bool())
        return _on_grid(logits, rows, cols, batch)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, :-1, :]


def policy_logp(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    if active() is not None:
        cells = _trained_cells(batch)
        logits, rows, cols = _packed_logits(model, batch, cells)
        return _on_grid(token_logp(logits, batch.input_ids[:, 1:][cells], temperature), rows, cols, batch)
    return token_logp(sequence_logits(model, batch), batch.input_ids[:, 1:], temperature)


def _logp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                  entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-softmax for both; the entropy keeps no vocabulary-sized graph unless ``entropy_grad``."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logp, entropy


def logp_and_entropy(model: torch.nn.Module, batch: PackedBatch, temperature: float, *,
                     entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies, float[B, L-1] each, from one forward and one log-softmax."""
    if active() is not None:
        cells = _trained_cells(batch)
        logits, rows, cols = _packed_logits(model, batch, cells)
        logp, entropy = _logp_entropy(logits, batch.input_ids[:, 1:][cells], temperature, entropy_grad)
        return _on_grid(logp, rows, cols, batch), _on_grid(entropy, rows, cols, batch)
    return _logp_entropy(sequence_logits(model, batch), batch.input_ids[:, 1:], temperature, entropy_grad)


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
