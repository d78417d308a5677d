"""What every trainer backend offers the server: one step on a batch, the weights to sync, checkpoints."""

from __future__ import annotations

import abc
import pathlib
from typing import Any

import torch

from services.trainer.batching import PackedBatch


class TrainerBackend(abc.ABC):
    """One rank's part of the trainer. Collective methods (``step``, ``state``, ``restore``) are called on every
    rank in the same order; the rest on rank 0 only (``save`` writes, ``weights`` feeds the weight-sync sender)."""

    rank: int = 0
    world: int = 1
    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    last_phases: dict[str, float]

    @abc.abstractmethod
    def step(self, batch: PackedBatch, version: int) -> dict[str, float]:
        """Train on ``batch`` at policy ``version``; the sync weights are current when this returns."""

    @abc.abstractmethod
    def weights(self) -> dict[str, torch.Tensor]:
        """Full tensors under the Hugging Face names; the same dict and tensors for the whole run."""

    def gather_weights(self) -> None:
        """Collective: bring ``weights()`` up to date before a checkpoint, for a backend that does not after every
        step (megatron with ``shard_sync``: the ranks send their own shards, so no full copy is needed per step)."""
        return None

    @abc.abstractmethod
    def save(self, path: str | pathlib.Path, *, version: int, state: dict[str, Any] | None = None,
             lineage: dict[str, Any] | None = None) -> pathlib.Path:
        """One Hugging Face checkpoint directory (resumable with ``state``)."""

    @abc.abstractmethod
    def state(self) -> dict[str, Any]:
        """What the checkpoint's HF files do not hold (optimizer, schedule, RNG, ...)."""

    @abc.abstractmethod
    def restore(self, path: str | pathlib.Path) -> dict[str, Any]:
        """Load a resumable checkpoint written by ``save``; returns the whole saved state."""

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

    def close(self) -> None:
        """Release what the backend holds beyond its memory (process groups)."""
        return None
