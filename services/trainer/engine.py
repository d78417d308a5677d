"""The trainer's models and optimizers as the config asks (policy, LoRA adapters, critic, reference),
one training step, the weights to sync, and checkpoints. No bus, no RPC: the server drives it."""

from __future__ import annotations

import pathlib
import random
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.trainer.batching import PackedBatch
from services.trainer.checkpoint import read_state, save_checkpoint
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

    def check_token_ids(self, batch: PackedBatch) -> None:
        """ValueError when a token id is outside the model's vocabulary (the step would fail on it)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        low, high = int(batch.input_ids.min()), int(batch.input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"prompt_ids / completion_ids: token ids {low}..{high} outside the vocabulary 0..{vocab - 1}")

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

    def save(self, path: str | pathlib.Path, *, version: int, state: dict[str, Any] | None = None,
             lineage: dict[str, Any] | None = None) -> pathlib.Path:
        """A Hugging Face checkpoint of the policy (LoRA: merged into the base weights), as of the last step;
        resumable with ``state`` (``{"engine": self.state(), ...}``)."""
        if self.merged is None:
            return save_checkpoint(self.model, self.tokenizer, path, version=version, state=state, lineage=lineage)
        return save_checkpoint(self.model.get_base_model(), self.tokenizer, path, version=version,
                               state_dict=dict(self.merged.tensors), state=state, lineage=lineage)

    def state(self) -> dict[str, Any]:
        """What the checkpoint's HF files do not hold: optimizer, schedule, RNG states, LoRA adapters, critic.
        The reference is never trained: it is rebuilt from its path."""
        out: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
            "rng": {"generator": self.generator.get_state(), "torch": torch.get_rng_state(),
                    "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []},
            "model_path": self.config.model_path, "algo": self.config.algo}
        if self.merged is not None:  # the HF files hold the merged weights; the adapters are what trains
            out["adapters"] = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        if self.critic is not None:
            c = self.critic
            out["critic"] = {"model": c.model.state_dict(), "optimizer": c.optimizer.state_dict(),
                             "schedule": c.schedule.state_dict()}
        return out

    def restore(self, path: str | pathlib.Path) -> dict[str, Any]:
        """Load a resumable checkpoint written by ``save`` into this engine (built from the same config);
        returns the whole saved state."""
        state = read_state(path)
        engine = state["engine"]
        if engine.get("model_path") != self.config.model_path or engine.get("algo") != self.config.algo:
            raise ValueError(f"checkpoint {path} was written for model_path={engine.get('model_path')!r} "
                             f"algo={engine.get('algo')!r}, not {self.config.model_path!r} {self.config.algo!r}")
        params = dict(self.model.named_parameters())
        if self.merged is None:
            _copy_into(params, _hf_tensors(pathlib.Path(path)), f"{path}")
        else:
            _copy_into({n: params[n] for n, p in params.items() if p.requires_grad}, engine["adapters"], f"{path}")
            self.merged.refresh()
        self.optimizer.load_state_dict(engine["optimizer"])
        self.schedule.load_state_dict(engine["schedule"])
        if self.critic is not None:
            self.critic.model.load_state_dict(engine["critic"]["model"])
            self.critic.optimizer.load_state_dict(engine["critic"]["optimizer"])
            self.critic.schedule.load_state_dict(engine["critic"]["schedule"])
        rng = engine["rng"]
        self.generator.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        return state


def _hf_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (one file or an index of shards)."""
    import json

    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(path / name))
    return out


@torch.no_grad()
def _copy_into(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``saved`` into ``params`` in place (the optimizer holds these tensors); every parameter must be there."""
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"{where}: no saved tensor for {missing[:3]} ({len(missing)} in all)")
    for name, param in params.items():
        if saved[name].shape != param.shape:
            raise ValueError(f"{where}: {name} is {tuple(saved[name].shape)}, the model has {tuple(param.shape)}")
        param.copy_(saved[name])
