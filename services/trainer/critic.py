"""The critic for presets with ``use_critic`` (``ppo``): the policy's backbone with a one-output linear
head (``AutoModelForTokenClassification``, num_labels=1), its own optimizer, trained with the
algorithm's clipped value loss."""

from __future__ import annotations

import dataclasses

import torch

from services.common.errors import FieldError
from services.common.hf_models import is_vision_language
from services.trainer.algorithms import Algorithm, masked_mean
from services.trainer.batching import PackedBatch
from services.trainer.forward import evaluating
from services.trainer.optim import OptimConfig, apply_update


@dataclasses.dataclass(kw_only=True)
class CriticConfig:
    model_path: str = ""  # backbone checkpoint; empty: the policy's initial checkpoint
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-4))

    def build(self, default_path: str, *, total_steps: int = 0) -> Critic:
        from transformers import AutoConfig, AutoModelForTokenClassification

        path = self.model_path or default_path
        if is_vision_language(path):
            raise FieldError("critic.model_path", f"{path} is a vision-language model; the critic takes a text model")
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
        with torch.no_grad():  # V = 0 everywhere at the start: the first advantages are the plain returns
            model.score.weight.zero_()
            if model.score.bias is not None:
                model.score.bias.zero_()
        return Critic(model, self.optim, total_steps=total_steps)


class Critic:
    """Values on the next-token grid: position t holds V(state before token t+1), float[B, L-1]."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, *, total_steps: int = 0) -> None:
        self.model = model.train()
        self.optim = optim
        self.optimizer, self.schedule = optim.build(model, total_steps=total_steps)

    def values(self, batch: PackedBatch) -> torch.Tensor:
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return out.logits[:, :-1, 0].float()

    def frozen_values(self, batch: PackedBatch) -> torch.Tensor:
        with evaluating(self.model):
            return self.values(batch)

    def update(self, algo: Algorithm, batch: PackedBatch, old_values: torch.Tensor,
               returns: torch.Tensor) -> dict[str, float]:
        """One optimizer update on the clipped value loss; stats prefixed ``value_``."""
        values = self.values(batch)
        loss, stats = algo.value_loss(values, old_values, returns, batch.loss_mask)
        applied = apply_update(self.model, self.optimizer, loss, self.optim.grad_clip, self.schedule)
        return {"value_loss": float(loss.detach()), **stats, "value_grad_norm": applied["grad_norm"],
                "value_mean": float(masked_mean(values.detach(), batch.loss_mask.bool())),
                "value_return_mean": float(masked_mean(returns, batch.loss_mask.bool()))}
