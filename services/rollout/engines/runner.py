"""Runs a Hugging Face causal LM over the scheduler's batch: prefill (KV rebuild) or one decode step."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from services.rollout.engines.sampler import sample
from services.rollout.engines.sequence import Sequence


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, pad_token_id: int, seed: int) -> None:
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    @torch.inference_mode()
    def run(self, rows: list[Sequence], rebuild: bool) -> tuple[list[int], list[float]]:
        logits = self._prefill(rows) if rebuild else self._decode(rows)
        params = [s.sampling for s in rows]
        tokens, logprobs = sample(
            logits,
            torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.top_k for p in params]),
            self.generator,
        )
        self._last = tokens
        return tokens.tolist(), logprobs.tolist()

    def _prefill(self, rows: list[Sequence]) -> torch.Tensor:
        contexts = [s.context for s in rows]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, width - len(ctx):] = torch.tensor(ctx)
            mask[i, width - len(ctx):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         cache=self._cache, use_cache=True, logits_to_keep=1)
        self._mask, self._positions = mask, positions[:, -1]
        return out.logits[:, -1, :]

    def _decode(self, rows: list[Sequence]) -> torch.Tensor:
        assert self._cache is not None and self._mask is not None
        assert len(rows) == self._mask.shape[0]
        self._mask = torch.cat([self._mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=-1)
        self._positions = self._positions + 1
        out = self.model(input_ids=self._last.unsqueeze(-1), attention_mask=self._mask,
                         position_ids=self._positions.unsqueeze(-1), cache=self._cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def drop_cache(self) -> None:
        self._cache = None
