"""The trainer's models and optimizers as the config asks (policy, LoRA adapters, critic, reference),
one training step, the weights to sync, and checkpoints. No bus, no RPC: the server drives it."""

from __future__ import annotations

import pathlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.trainer.batching import PackedBatch
from services.trainer.checkpoint import save_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.lora import MergedWeights, is_lora
from services.trainer.step import train_step


class TrainerEngine:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.algo = config.build_algorithm()
        base = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.model = config.lora.build(base).train()
        self.merged = MergedWeights(self.model) if is_lora(self.model) else None
        self.optimizer, self.schedule = config.optim.build(self.model, total_steps=config.total_steps)
        self.critic = config.critic.build(config.model_path, total_steps=config.total_steps) \
            if self.algo.needs_critic else None
        self.reference = config.reference.build(self.model, config.model_path) \
            if self.algo.needs_reference or config.reference.always else None
        self.generator = torch.Generator().manual_seed(config.seed)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def step(self, batch: PackedBatch, version: int) -> dict[str, float]:
        """Train on ``batch`` at policy ``version``; the sync weights are current when this returns."""
        metrics = train_step(self.model, self.optimizer, self.algo, batch, version=version, optim=self.config.optim,
                             temperature=self.config.temperature, generator=self.generator, schedule=self.schedule,
                             critic=self.critic, reference=self.reference, sft_min_reward=self.config.sft_min_reward)
        if self.merged is not None:
            self.merged.refresh()
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        """Full tensors under the Hugging Face canonical names, for the weight-sync sender. The dict and its
        tensors stay the same objects for the whole run (LoRA: merged copies refreshed by ``step``)."""
        if self.merged is not None:
            return self.merged.tensors
        return dict(self.model.named_parameters())

    def save(self, path: str | pathlib.Path, *, version: int) -> pathlib.Path:
        """A plain Hugging Face checkpoint of the policy (LoRA: merged into the base weights)."""
        if self.merged is None:
            return save_checkpoint(self.model, self.tokenizer, path, version=version)
        return save_checkpoint(self.model.get_base_model(), self.tokenizer, path, version=version,
                               state_dict=dict(self.merged.tensors))  # as of the last step
