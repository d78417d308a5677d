"""The single-process backend: one full copy of the policy (LoRA adapters, critic, reference as the config asks)
on one device, one training step, the weights to sync, and checkpoints. No bus, no RPC: the server drives it."""

from __future__ import annotations

import json
import pathlib
import random
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from services.common.cpu_features import describe, native_bf16
from services.common.device import host_copy, resolve_device
from services.common.errors import FieldError
from services.common.hf_models import load_lm
from services.common.logging import get_logger
from services.common.moe_routing import routers_of
from services.trainer.backends.base import TrainerBackend
from services.trainer.batching import PackedBatch
from services.trainer.checkpoint import read_state, save_checkpoint
from services.trainer.config import TrainerConfig
from services.trainer.lora import MergedWeights, adapter_tensors, is_lora
from services.trainer.packing import packed_forwards
from services.trainer.reference import check_teacher_tokenizer
from services.trainer.served_reference import ServedReference
from services.trainer.step import train_step


def bf16_runs_natively(device: torch.device) -> bool:
    """``dtype: bfloat16`` on a CPU without native bf16 computes in float32: emulated bf16 autocast is ~18x slower
    there (an MLP step 496 ms against 28 ms, `services/common/cpu_features.py`) and no more exact."""
    if device.type != "cpu" or native_bf16():
        return True
    get_logger().warning("trainer_bf16_emulated", **describe(),
                         reason="dtype: bfloat16 asked, but this CPU has no native bf16: computing in float32")
    return False


def checkpoint_activations(model: torch.nn.Module) -> None:
    """Hugging Face's gradient checkpointing on every decoder layer (non-reentrant: LoRA's frozen inputs need no
    grad); FieldError for a model that cannot (Megatron's own recompute settings are its config's)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise FieldError("gradient_checkpointing", f"{type(model).__name__} cannot recompute its activations here "
                                                   "(Hugging Face models that support it can)")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


class TorchBackend(TrainerBackend):
    shards = None  # data-parallel row shards for train_step (FSDP2); None: this process trains every row
    forwards = None  # how train_step runs the policy (megatron pp > 1: its pipeline schedule); None: directly

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.algo = config.build_algorithm()
        self.device = self.resolve_device()
        self.bf16 = config.dtype == "bfloat16" and bf16_runs_natively(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        policy = self.load_policy()
        if config.gradient_checkpointing:
            checkpoint_activations(policy)
        self.model = self.prepare(config.lora.build(policy))
        self.merged = MergedWeights(self.model) if is_lora(self.model) else None
        # lora.sync adapter: the weight sync sends the adapters alone (aliases of the trained parameters)
        self.adapters = adapter_tensors(self.model) if self.merged is not None and config.lora.sync == "adapter" \
            else None
        self.routers = self.replay_routes() if config.routing_replay else None
        self.optimizer, self.schedule = config.optim.build(self.model, total_steps=config.total_steps)
        self.critic = config.critic.build(config.model_path, total_steps=config.total_steps) \
            if self.algo.needs_critic else None
        if (self.algo.config.distill_coef > 0 or self.algo.config.distill_topk > 0) and not config.reference.url:
            check_teacher_tokenizer(self.tokenizer, config.reference.model_path)
        self.reference = config.reference.build(self.model, config.model_path) \
            if self.algo.needs_reference or config.reference.always else None
        if isinstance(self.reference, ServedReference):
            self.reference.check_tokenizer(self.tokenizer)
        for extra in (self.critic, self.reference):  # loaded on the host from their paths
            if extra is not None and not isinstance(extra, ServedReference):
                extra.model.to(self.device)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.optimizer_seconds = 0.0  # time inside optimizer.step(), for the step's phase times
        self.last_phases: dict[str, float] = {}  # phase_<name>_seconds of the last step (not in its metrics)
        self.optimizer.register_step_pre_hook(self._optimizer_started)
        self.optimizer.register_step_post_hook(self._optimizer_done)

    def replay_routes(self):
        """The policy's routers, hooked for MoE routing replay (ValueError for a model without routers)."""
        try:
            return routers_of(self.model)
        except ValueError as exc:
            raise FieldError("routing_replay", str(exc)) from None

    def resolve_device(self) -> torch.device:
        return resolve_device(self.config.device)

    def load_policy(self) -> torch.nn.Module:
        """The policy as its checkpoint holds it (Megatron: this rank's shards behind a causal-LM interface)."""
        return load_lm(self.config.model_path, torch.float32)

    def clip_grads(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` in place; the norm before clipping (Megatron: over its ranks)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as it trains here (FSDP2: sharded over the ranks)."""
        return model.to(self.device).train()

    def _optimizer_started(self, *_) -> None:
        self._optimizer_start = time.perf_counter()

    def _optimizer_done(self, *_) -> None:
        self.optimizer_seconds += time.perf_counter() - self._optimizer_start

    def step(self, batch: PackedBatch, version: int) -> dict[str, float]:
        batch = batch.to(self.device)
        optimizer_before, phases = self.optimizer_seconds, {}
        with self.autocast(), packed_forwards(self.config.packing):
            metrics = train_step(self.model, self.optimizer, self.algo, batch, version=version, optim=self.config.optim,
                                 temperature=self.config.temperature, generator=self.generator,
                                 schedule=self.schedule, critic=self.critic, reference=self.reference,
                                 sft_min_reward=self.config.sft_min_reward, phases=phases, shards=self.shards,
                                 clip=self.clip_grads, forwards=self.forwards)
        if self.routers is not None:
            metrics.update(self.routers.take_stats())
        self.refresh_weights()
        optimizer = self.optimizer_seconds - optimizer_before  # the update splits into backward and optimizer step
        phases.update(optimizer=optimizer, backward=max(0.0, phases.pop("update", 0.0) - optimizer))
        self.last_phases = {f"phase_{name}_seconds": value for name, value in phases.items()}
        return metrics

    def refresh_weights(self) -> None:
        """Bring the tensors ``weights()`` returns up to date after an update (LoRA: re-merge)."""
        if self.merged is not None:
            self.merged.refresh()

    def autocast(self) -> torch.autocast:
        """``dtype: bfloat16``: forwards and backwards in bf16; the weights and the optimizer's state stay
        float32 (the weights sync as float32; an engine holding bf16 weights casts them on receipt)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def weights(self) -> dict[str, torch.Tensor]:
        """What the weight sync sends. LoRA: merged copies refreshed by ``step`` (``lora.sync: adapter``: the
        adapters alone); else the parameters themselves."""
        if self.adapters is not None:
            return self.adapters
        if self.merged is not None:
            return self.merged.tensors
        return dict(self.model.named_parameters())

    def save(self, path: str | pathlib.Path, *, version: int, state: dict[str, Any] | None = None,
             lineage: dict[str, Any] | None = None) -> pathlib.Path:
        """LoRA: merged into the base weights."""
        if self.merged is None:
            weights = None if self.device.type == "cpu" else host_copy(self.model.state_dict())  # host copies
            return save_checkpoint(self.model, self.tokenizer, path, version=version, state_dict=weights, state=state,
                                   lineage=lineage)
        return save_checkpoint(self.model.get_base_model(), self.tokenizer, path, version=version,
                               state_dict=host_copy(dict(self.merged.tensors)), state=state, lineage=lineage)

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, saved: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(saved)

    def state(self) -> dict[str, Any]:
        """The reference is never trained: it is rebuilt from its path."""
        out: dict[str, Any] = {
            "optimizer": self.optimizer_state(), "schedule": self.schedule.state_dict(),
            "rng": {"generator": self.generator.get_state(), "torch": torch.get_rng_state(),
                    "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []},
            "model_path": self.config.model_path, "algo": self.config.algo, "backend": self.config.backend}
        if self.merged is not None:  # the HF files hold the merged weights; the adapters are what trains
            out["adapters"] = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        if self.critic is not None:
            c = self.critic
            out["critic"] = {"model": c.model.state_dict(), "optimizer": c.optimizer.state_dict(),
                             "schedule": c.schedule.state_dict()}
        return host_copy(out)  # optimizer and critic states from the device

    def restore(self, path: str | pathlib.Path) -> dict[str, Any]:
        """Into this backend, built from the same config."""
        state = read_state(path)
        engine = state["engine"]
        check_written_for(engine, self.config, path)
        params = dict(self.model.named_parameters())
        if self.merged is None:
            copy_into(params, hf_tensors(pathlib.Path(path)), f"{path}")
        else:
            copy_into({n: params[n] for n, p in params.items() if p.requires_grad}, engine["adapters"], f"{path}")
            self.merged.refresh()
        self.load_optimizer_state(engine["optimizer"])
        if self.critic is not None:
            self.critic.model.load_state_dict(engine["critic"]["model"])
            self.critic.optimizer.load_state_dict(engine["critic"]["optimizer"])
            self.critic.schedule.load_state_dict(engine["critic"]["schedule"])
        self.load_schedule_and_rng(engine)
        return state

    def load_schedule_and_rng(self, engine: dict[str, Any]) -> None:
        self.schedule.load_state_dict(engine["schedule"])
        rng = engine["rng"]
        self.generator.set_state(rng["generator"])
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


def check_written_for(engine: dict[str, Any], config: TrainerConfig, path: str | pathlib.Path) -> None:
    """ValueError unless the checkpoint's state was written by a backend of this model, preset and kind (the
    optimizer state's layout differs between backends)."""
    written = (engine.get("model_path"), engine.get("algo"), engine.get("backend", "torch"))
    if written != (config.model_path, config.algo, config.backend):
        raise ValueError(f"checkpoint {path} was written for model_path={written[0]!r} algo={written[1]!r} "
                         f"backend={written[2]!r}, not {config.model_path!r} {config.algo!r} {config.backend!r}")


def hf_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (one file or an index of shards)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(path / name))
    return out


@torch.no_grad()
def copy_into(params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``saved`` into ``params`` in place (the optimizer holds these tensors); every parameter must be there."""
    missing = sorted(set(params) - set(saved))
    if missing:
        raise FieldError(where, f"no saved tensor for {missing[:3]} ({len(missing)} in all)")
    for name, param in params.items():
        if saved[name].shape != param.shape:
            raise FieldError(where, f"{name} is {tuple(saved[name].shape)}, the model has {tuple(param.shape)}")
        param.copy_(saved[name])
