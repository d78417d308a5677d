"""Offline objectives on online batches. Torch only, no I/O.

``sft``: rejection-sampling fine-tuning, the NLL of the samples whose reward exceeds ``sft_min_reward``.
``dpo``: one preference pair per prompt group (highest vs lowest reward, ties skipped) against the
frozen reference. A batch with nothing to train on makes no update (``updates`` = 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.trainer.algorithms import Algorithm, masked_mean, token_entropy, token_logp
from services.trainer.batching import PackedBatch
from services.trainer.forward import frozen_logp, sequence_logits
from services.trainer.optim import OptimConfig, StatsMean, apply_update
from services.trainer.selection import dpo_pairs, sft_rows
from services.trainer.step import batch_metrics, kl_to_reference, minibatches

if TYPE_CHECKING:
    from services.trainer.reference import Reference


def _logp_entropy(model: torch.nn.Module, mb: PackedBatch, temperature: float) -> tuple[torch.Tensor, float]:
    logits = sequence_logits(model, mb)
    with torch.no_grad():
        entropy = float(masked_mean(token_entropy(logits.detach(), temperature), mb.loss_mask.bool()))
    return token_logp(logits, mb.input_ids[:, 1:], temperature), entropy


def offline_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, algo: Algorithm, batch: PackedBatch, *,
                 version: int, optim: OptimConfig, temperature: float, generator: torch.Generator,
                 schedule: torch.optim.lr_scheduler.LRScheduler | None = None, reference: Reference | None = None,
                 sft_min_reward: float = 0.0) -> dict[str, float]:
    model.train()
    metrics = batch_metrics(batch, version)
    if algo.config.objective == "sft":
        rows = sft_rows(batch.rewards, sft_min_reward)
        metrics["samples_kept"] = float(rows.numel())
        return {**metrics, **_sft(model, optimizer, algo, batch.rows(rows), optim, temperature, generator, schedule)}
    if reference is None:
        raise ValueError("algorithm objective 'dpo' needs a reference model")
    chosen, rejected = dpo_pairs(batch.rewards, batch.group_ids)
    metrics.update(dpo_pairs=float(chosen.numel()), samples_kept=2.0 * chosen.numel(),
                   groups_tied=float(torch.unique(batch.group_ids).numel() - chosen.numel()))
    if chosen.numel() == 0:
        return {**metrics, "updates": 0.0}
    pairs = batch.rows(torch.cat([chosen, rejected]))
    ref = reference.logp(pairs, temperature)
    metrics["kl_ref_k3"] = kl_to_reference(frozen_logp(model, pairs, temperature), ref, pairs.loss_mask)
    ref_seq = algo.sequence_logp(ref, pairs.loss_mask)
    n = chosen.numel()
    acc = StatsMean()
    for part in minibatches(n, optim, generator):
        rows = torch.cat([part, part + n])  # the chosen halves, then their rejected partners
        mb = pairs.rows(rows)
        logp, entropy = _logp_entropy(model, mb, temperature)
        seq = algo.sequence_logp(logp, mb.loss_mask)
        k = part.numel()
        loss, stats = algo.preference_loss(seq[:k], seq[k:], ref_seq[part], ref_seq[part + n])
        if torch.isfinite(loss):
            acc.add({**stats, "loss": float(loss.detach()), "entropy": entropy,
                     **apply_update(model, optimizer, loss, optim.grad_clip, schedule)})
    return {**metrics, **acc.result()}


def _sft(model: torch.nn.Module, optimizer: torch.optim.Optimizer, algo: Algorithm, batch: PackedBatch,
         optim: OptimConfig, temperature: float, generator: torch.Generator,
         schedule: torch.optim.lr_scheduler.LRScheduler | None) -> dict[str, float]:
    acc = StatsMean()
    for part in minibatches(batch.size, optim, generator):
        mb = batch.rows(part)
        logp, entropy = _logp_entropy(model, mb, temperature)
        loss, stats = algo.policy_loss(logp=logp, prox_logp=None, behav_logp=mb.behav_logp,
                                       advantages=torch.zeros_like(logp), loss_mask=mb.loss_mask)
        if torch.isfinite(loss):
            acc.add({**stats, "entropy": entropy, **apply_update(model, optimizer, loss, optim.grad_clip, schedule)})
    return acc.result()
