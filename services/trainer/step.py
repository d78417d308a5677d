"""One training step on a packed batch with a configured algorithm. Torch only, no I/O.

Online presets: recompute proximal log-probs, reference log-probs and critic values (no grad) ->
dynamic-sampling filter -> advantages -> minibatch updates of the policy (and the critic).
Offline presets (``sft``, ``dpo``) go to ``offline_step``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from services.trainer.algorithms import Algorithm, kl_estimate, masked_mean, token_entropy
from services.trainer.batching import PackedBatch, batch_staleness
from services.trainer.forward import Forwards, policy_logp, sequence_logits
from services.trainer.optim import Clip, OptimConfig, StatsMean

if TYPE_CHECKING:
    from services.trainer.backends.shards import RowShards
    from services.trainer.critic import Critic
    from services.trainer.reference import Reference

__all__ = ["OptimConfig", "batch_metrics", "kl_to_reference", "policy_logp", "sequence_logits", "train_step"]


def batch_metrics(batch: PackedBatch, version: int) -> dict[str, float]:
    """What the batch is, before any filtering: size, reward, length, staleness histogram."""
    return {"reward_mean": float(batch.rewards.mean()), "samples": float(batch.size),
            "completion_tokens_mean": float(batch.lengths.float().mean()),
            "truncated_fraction": float(batch.truncated.float().mean()),
            "process_rewards": float(batch.step_mask.sum()), **batch_staleness(batch.versions, version)}


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """k3 estimate of KL(pi || ref) over the trained tokens: >= 0, and 0 exactly when pi == ref."""
    mask = loss_mask.bool()
    kl = kl_estimate(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0), "k3")
    return float(masked_mean(kl, mask)) if mask.any() else 0.0


def step_entropy(logits: torch.Tensor, temperature: float, *, with_grad: bool) -> torch.Tensor:
    """Per-token entropy: differentiable when the loss has an entropy bonus, else a no-grad metric (no
    vocabulary-sized graph kept for the backward pass)."""
    if with_grad:
        return token_entropy(logits, temperature)
    with torch.no_grad():
        return token_entropy(logits.detach(), temperature)


def minibatches(n: int, optim: OptimConfig, generator: torch.Generator, groups: torch.Tensor | None = None):
    """Index tensors of each minibatch of each epoch, shuffled per epoch: rows, or with `groups` (each row's
    group id) and `optim.split` "groups", whole groups (at most one minibatch per group)."""
    for _ in range(optim.epochs):
        if groups is None or optim.split == "rows":
            order = torch.randperm(n, generator=generator)
            parts = torch.tensor_split(order, min(optim.minibatches, max(1, n)))
        else:
            _, group_of = torch.unique(groups, return_inverse=True)
            order = torch.randperm(int(group_of.max()) + 1 if n else 0, generator=generator)
            parts = [torch.nonzero(torch.isin(group_of, chosen)).squeeze(-1)
                     for chosen in torch.tensor_split(order, min(optim.minibatches, max(1, order.numel())))]
        for part in parts:
            if part.numel():
                yield part


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, algo: Algorithm, batch: PackedBatch, *,
               version: int, optim: OptimConfig, temperature: float, generator: torch.Generator,
               schedule: torch.optim.lr_scheduler.LRScheduler | None = None, critic: Critic | None = None,
               reference: Reference | None = None, sft_min_reward: float = 0.0,
               phases: dict[str, float] | None = None, shards: RowShards | None = None,
               clip: Clip | None = None, forwards: Forwards | None = None) -> dict[str, float]:
    """One step of ``algo`` on ``batch``; returns the step's metrics (means over updates, maxima for ``*_max``).
    ``phases``, when given, receives the seconds spent in each phase (kept out of the metrics: those are a
    deterministic function of the inputs). ``shards`` (data-parallel ranks, each holding the whole batch): the
    no-grad forwards are split across the ranks and gathered, each rank trains its share of every minibatch
    with its loss weighted by its share of the minibatch's loss weight, and the stats are reduced over ranks.
    ``clip``: see ``optim.apply_update``. ``forwards``: how the policy's forwards and backward run (default:
    directly on ``model``; a pipeline-parallel policy through its stages)."""
    phases = {} if phases is None else phases
    if algo.is_offline:
        from services.trainer.offline_step import offline_step

        return offline_step(model, optimizer, algo, batch, version=version, optim=optim, temperature=temperature,
                            generator=generator, schedule=schedule, reference=reference, sft_min_reward=sft_min_reward)
    if algo.needs_critic and critic is None:
        raise ValueError(f"algorithm {algo.config.preset or algo.config.objective!r} needs a critic")
    if algo.needs_reference and reference is None:
        raise ValueError(f"algorithm {algo.config.preset or algo.config.objective!r} needs a reference model")
    model.train()
    forwards = forwards or Forwards(model)
    metrics = batch_metrics(batch, version)
    report = algo.filter_groups_report(batch.rewards, batch.group_ids)
    metrics.update(report.stats(), samples_kept=float(report.keep.sum()))
    if not report.keep.all():
        batch = batch.rows(torch.nonzero(report.keep).squeeze(-1))
    if batch.size == 0:
        return {**metrics, "updates": 0.0}
    started = time.perf_counter()
    def every_row(fn):
        return fn(batch) if shards is None else shards.gather_rows(fn, batch)

    prox = every_row(lambda b: forwards.frozen_logp(b, temperature)) if algo.needs_prox_logp else None
    k = algo.config.distill_topk
    teacher = None
    if reference is not None and k > 0:
        # one teacher forward (or call) for its log-probs and its top-k; every rank holds the whole batch and asks
        # for all of it (the top-k is not split over ranks)
        ref, teacher = reference.logp_and_top(batch, temperature, k)
    else:
        ref = every_row(lambda b: reference.logp(b, temperature)) if reference is not None else None
    if ref is not None:
        start = prox if prox is not None else every_row(lambda b: forwards.frozen_logp(b, temperature))
        metrics["kl_ref_k3"] = kl_to_reference(start, ref, batch.loss_mask)
    old_values = critic.frozen_values(batch) if critic is not None else None
    phases["recompute"] = time.perf_counter() - started  # no-grad forwards: prox, reference, critic
    result = algo.compute_advantages(
        batch.rewards, batch.group_ids, batch.loss_mask, values=old_values,
        old_logp=prox if prox is not None else batch.behav_logp, ref_logp=ref, lengths=batch.lengths,
        truncated=batch.truncated, step_rewards=batch.step_rewards, step_mask=batch.step_mask)
    metrics["shaped_reward_mean"] = float(result.rewards.mean())
    metrics["advantage_abs_mean"] = float(masked_mean(result.advantages.abs(), batch.loss_mask.bool()))
    if result.kl_penalty is not None:
        metrics["kl_reward_mean"] = float(masked_mean(result.kl_penalty, batch.loss_mask.bool()))
    acc, skipped = StatsMean(), 0
    forward = update = 0.0
    for part in minibatches(batch.size, optim, generator, batch.group_ids):
        started = time.perf_counter()
        scale = weight = 1.0
        if shards is not None:
            part, scale, weight = shards.split(part, batch.loss_mask, algo.loss_weight)
        mb = batch.rows(part)

        def loss_of(rows, logp, entropy, teacher_kl, mb=mb, part=part, scale=scale):
            sub, at = (mb, part) if rows is None else (mb.rows(rows), part[rows])
            loss, stats = algo.policy_loss(
                logp=logp, prox_logp=None if prox is None else prox[at], behav_logp=sub.behav_logp,
                advantages=result.advantages[at], loss_mask=sub.loss_mask, versions=sub.versions,
                current_version=version, entropy=entropy, ref_logp=None if ref is None else ref[at],
                teacher_kl=teacher_kl)
            return loss * scale, stats

        loss, stats = forwards.loss(mb, temperature, entropy_grad=algo.config.entropy_coef > 0, loss_of=loss_of,
                                    teacher=None if teacher is None else teacher.rows(part))
        if shards is not None:
            stats = shards.mean_stats(stats, weight)
        finite = bool(torch.isfinite(loss)) if shards is None else shards.all_finite(loss)
        forward += time.perf_counter() - started
        if not finite:  # never step on a NaN / inf loss
            skipped += 1
            continue
        started = time.perf_counter()
        stats.update(forwards.update(optimizer, loss, optim.grad_clip, schedule, clip))
        if critic is not None:
            stats.update(critic.update(algo, mb, old_values[part], result.returns[part]))
        update += time.perf_counter() - started
        acc.add(stats)
    metrics.update(acc.result(), nonfinite_skipped=float(skipped))
    phases.update(forward=forward, update=update)  # update: backward, clipping, optimizer step (and critic)
    return metrics
