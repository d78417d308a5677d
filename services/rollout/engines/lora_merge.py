"""LoRA adapters as the embedded engine's weights: the weight sync sends only the adapters (A, B of every adapted
linear), and the engine merges them into its own copies of the base weights.

A trainer training LoRA changes only its adapters; sending the merged weights moves every byte of every adapted
matrix at each update (and a delta of them is dense: B @ A touches every element). Here the receiver's layout is
the adapters alone, under the trainer's canonical names (`<module>.lora_A.weight` [r, in], `<module>.lora_B.weight`
[out, r]), so an update moves the adapters' bytes. At resume the engine sets each adapted weight to
base + (B @ A) * alpha / r, as peft's merge computes it, from a copy of the base weight taken at load (the base never
changes: both sides load it from the same checkpoint).
"""

from __future__ import annotations

import dataclasses

import torch

from services.common.errors import FieldError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(kw_only=True)
class AdapterConfig:
    """`engine.lora`: r 0 takes full weights; r > 0 takes the trainer's LoRA adapters (its lora.r, lora.alpha and
    lora.target_modules; a run file sets these from the trainer's when its lora.sync is adapter)."""
    r: int = 0
    alpha: float = 16.0
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_TARGETS))

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 0:
            raise FieldError("engine.lora.r", f"must be an integer >= 0 (0: full weights), got {self.r!r}")
        if self.alpha <= 0:
            raise FieldError("engine.lora.alpha", f"must be > 0, got {self.alpha}")
        if self.r and not self.target_modules:
            raise FieldError("engine.lora.target_modules", "must name at least one module")

    @property
    def enabled(self) -> bool:
        return self.r > 0


class AdapterMerge:
    """Adapter buffers for the model's targeted linears and the merge into their weights."""

    def __init__(self, model: torch.nn.Module, config: AdapterConfig) -> None:
        assert config.enabled
        self.scale = config.alpha / config.r
        targets = set(config.target_modules)
        self.layers: dict[str, torch.nn.Linear] = {
            name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets}
        if not self.layers:
            raise FieldError("engine.lora.target_modules", f"no linear layer of the model is named one of "
                             f"{sorted(targets)}")
        self.base = {name: m.weight.detach().clone() for name, m in self.layers.items()}
        self.tensors: dict[str, torch.Tensor] = {}
        for name, m in self.layers.items():
            out_features, in_features = m.weight.shape
            self.tensors[f"{name}.lora_A.weight"] = torch.zeros(config.r, in_features, device=m.weight.device)
            self.tensors[f"{name}.lora_B.weight"] = torch.zeros(out_features, config.r, device=m.weight.device)

    @torch.no_grad()
    def merge(self) -> None:
        """Every adapted weight := base + (B @ A) * alpha / r, computed in float32 and cast to the weight's dtype."""
        for name, m in self.layers.items():
            delta = (self.tensors[f"{name}.lora_B.weight"] @ self.tensors[f"{name}.lora_A.weight"]) * self.scale
            m.weight.copy_((self.base[name].float() + delta).to(m.weight.dtype))
