"""Tiny models shared by the weight-exchange tests."""

from __future__ import annotations

import torch

from services.trainer.models.tiny_qwen3 import TinyQwen3Config

VOCAB = 264


def tiny_qwen3(seed: int, dtype: torch.dtype = torch.float32, experts: int = 0) -> torch.nn.Module:
    """`experts` > 0: the Qwen3-MoE of the same shape (that many top-2 experts a layer)."""
    torch.manual_seed(seed)
    return TinyQwen3Config(num_experts=experts).build(VOCAB).to(dtype)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Change every weight (as an optimizer step would), deterministically."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.01)
