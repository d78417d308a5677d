"""LoRA through ``peft``: wrapping the policy, and its merged weights under Hugging Face canonical names.

The rollout and Hugging Face checkpoints know only the plain model's parameter names
(``model.layers.0.self_attn.q_proj.weight``). ``MergedWeights`` keeps one full tensor per such name:
adapted weights are merged copies (``W + B @ A * alpha / r``, refreshed in place), every other tensor
aliases the frozen base parameter, so the weight-sync sender can hold the dict for the whole run.
"""

from __future__ import annotations

import dataclasses

import torch

from services.common.errors import FieldError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_SYNCS = ("merged", "adapter")


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_TARGETS))
    # what the weight sync sends: merged (every weight, adapters merged in: any engine) | adapter (the adapters' A
    # and B only; the embedded engine merges them, its engine.lora set from these settings by the run file)
    sync: str = "merged"

    def __post_init__(self) -> None:
        if self.sync not in LORA_SYNCS:
            raise FieldError("lora.sync", f"must be one of {', '.join(LORA_SYNCS)}, got {self.sync!r}")
        if self.r < 1:
            raise FieldError("lora.r", f"must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise FieldError("lora.alpha", f"must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise FieldError("lora.dropout", f"must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise FieldError("lora.target_modules", "must name at least one module")

    def build(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model wrapped with fresh adapters (only they train), or the model itself when disabled."""
        if not self.enabled:
            return model
        import peft

        config = peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                                 target_modules=list(self.target_modules), task_type="CAUSAL_LM")
        try:
            return peft.get_peft_model(model, config)
        except ValueError as exc:
            raise FieldError("lora.target_modules", f"{exc}") from exc


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def _is_adapter_param(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


class MergedWeights:
    """``tensors``: canonical name -> full tensor of the merged model (call ``refresh()`` after updates)."""

    def __init__(self, model: torch.nn.Module, adapter: str = "default") -> None:
        from peft.tuners.lora import LoraLayer

        base = model.get_base_model()
        self.adapter = adapter
        self._layers = {f"{name}.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
        self.tensors: dict[str, torch.Tensor] = {}
        for name, param in base.named_parameters():  # tied weights appear once, as in the plain model
            if not _is_adapter_param(name):
                self.tensors[name.replace(".base_layer.", ".")] = param.detach()
        for name, layer in self._layers.items():
            self.tensors[name] = self._merged(layer).clone()

    def _merged(self, layer) -> torch.Tensor:
        base = layer.get_base_layer().weight
        return base + layer.get_delta_weight(self.adapter).to(base.dtype)

    @torch.no_grad()
    def refresh(self) -> dict[str, torch.Tensor]:
        for name, layer in self._layers.items():
            self.tensors[name].copy_(self._merged(layer))
        return self.tensors


def adapter_tensors(model: torch.nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapters under canonical names (``<module>.lora_A.weight`` [r, in], ``<module>.lora_B.weight`` [out, r]),
    aliasing the trained parameters: what ``lora.sync: adapter`` sends (the receiver merges them with
    alpha / r, services/rollout/engines/lora_merge.py)."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    for name, m in model.get_base_model().named_modules():
        if isinstance(m, LoraLayer):
            out[f"{name}.lora_A.weight"] = m.lora_A[adapter].weight.detach()
            out[f"{name}.lora_B.weight"] = m.lora_B[adapter].weight.detach()
    return out
