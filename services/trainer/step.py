"""One optimizer step on a packed batch with a configured algorithm. Torch only, no I/O."""

from __future__ import annotations

import dataclasses

import torch

from services.trainer.algorithms import Algorithm, token_entropy, token_logp
from services.trainer.batching import PackedBatch


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    minibatches: int = 1   # optimizer updates per training batch
    epochs: int = 1        # passes over the batch
    warmup_updates: int = 0  # linear learning-rate warm-up over this many optimizer updates
    schedule: str = "constant"  # "constant" or "linear" (decay to min_lr_ratio * lr at the last update)
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr: must be > 0, got {self.lr}")
        if self.minibatches < 1 or self.epochs < 1:
            raise ValueError("optim.minibatches / optim.epochs: must be >= 1")
        if self.schedule not in ("constant", "linear"):
            raise ValueError(f"optim.schedule: must be 'constant' or 'linear', got {self.schedule!r}")

    def build(self, model: torch.nn.Module, *, total_steps: int = 0
              ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay,
                                      betas=tuple(self.betas))
        total = total_steps * self.minibatches * self.epochs
        if self.schedule == "linear" and not total:
            raise ValueError("optim.schedule: 'linear' needs total_steps > 0")
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: self.lr_factor(n, total))

    def lr_factor(self, update: int, total_updates: int) -> float:
        warm = min(1.0, (update + 1) / (self.warmup_updates + 1))
        if self.schedule == "constant" or update < self.warmup_updates:
            return warm
        span = max(1, total_updates - self.warmup_updates)
        done = min(1.0, (update - self.warmup_updates) / span)
        return 1.0 - (1.0 - self.min_lr_ratio) * done


def sequence_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, :-1, :]


def policy_logp(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    return token_logp(sequence_logits(model, batch), batch.input_ids[:, 1:], temperature)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, algo: Algorithm, batch: PackedBatch, *,
               version: int, optim: OptimConfig, temperature: float, generator: torch.Generator,
               schedule: torch.optim.lr_scheduler.LRScheduler | None = None) -> dict[str, float]:
    """Decoupled-PPO style update: recompute proximal log-probs, advantages, then minibatch updates."""
    model.train()
    prox = None
    if algo.needs_prox_logp:
        with torch.no_grad():
            prox = policy_logp(model, batch, temperature)
    keep = algo.filter_groups(batch.rewards, batch.group_ids)
    advantages = algo.advantages(batch.rewards, batch.group_ids, batch.loss_mask)
    rows = torch.nonzero(keep).squeeze(-1)
    metrics: dict[str, float] = {"reward_mean": float(batch.rewards.mean()), "samples": float(batch.size),
                                 "samples_kept": float(rows.numel()),
                                 "completion_tokens_mean": float(batch.loss_mask.sum(-1).mean())}
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(optim.epochs):
        order = rows[torch.randperm(rows.numel(), generator=generator)]
        for part in torch.tensor_split(order, min(optim.minibatches, max(1, order.numel()))):
            if part.numel() == 0:
                continue
            mb = batch.rows(part)
            logits = sequence_logits(model, mb)
            logp = token_logp(logits, mb.input_ids[:, 1:], temperature)
            with torch.no_grad():
                entropy = token_entropy(logits.detach(), temperature)
            loss, stats = algo.policy_loss(
                logp=logp, prox_logp=None if prox is None else prox[part], behav_logp=mb.behav_logp,
                advantages=advantages[part], loss_mask=mb.loss_mask, versions=mb.versions, current_version=version,
                entropy=entropy)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
            optimizer.step()
            if schedule is not None:
                schedule.step()
            stats["grad_norm"] = float(grad_norm)
            stats["lr"] = optimizer.param_groups[0]["lr"]
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            updates += 1
    metrics.update({k: v / max(updates, 1) for k, v in sums.items()})
    metrics["updates"] = float(updates)
    return metrics
