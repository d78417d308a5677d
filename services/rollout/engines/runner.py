"""Runs a Hugging Face causal LM over the scheduler's steps: a full prefill, or a decode of the kept rows plus a
prefill of the admitted ones merged into the same left-padded KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from services.rollout.engines.sampler import sample
from services.rollout.engines.scheduler import Step
from services.rollout.engines.sequence import Sequence


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, pad_token_id: int, seed: int) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device  # every tensor of the engine lives here
        self.pad_token_id = pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None       # [rows, kv width], 0 on each row's left padding
        self._positions: torch.Tensor | None = None  # [rows], position of each row's last token
        self._last: torch.Tensor | None = None       # [rows], each row's last sampled token
        self.prefilled_rows = 0                      # rows whose whole context went through the model
        self.prefilled_contexts = 0                  # ... counted once per distinct context (shared prompts)

    @torch.inference_mode()
    def run(self, step: Step) -> tuple[list[int], list[float]]:
        logits = self._full(step.rows) if step.prefill or not self._can_extend(step) else self._extend(step)
        params = [s.sampling for s in step.rows]
        tokens, logprobs = sample(
            logits,
            torch.tensor([p.temperature for p in params], device=self.device),
            torch.tensor([p.top_p for p in params], device=self.device),
            torch.tensor([p.top_k for p in params], device=self.device),
            self.generator,
        )
        self._last = tokens
        return tokens.tolist(), logprobs.tolist()

    def drop_cache(self) -> None:
        self._cache = None

    # full prefill -------------------------------------------------------------------------------------------
    def _full(self, rows: list[Sequence]) -> torch.Tensor:
        self._cache, self._mask, self._positions, logits = self._prefill(rows)
        return logits

    def _prefill(self, rows: list[Sequence]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run each distinct context once (the samples of one prompt share it), then give every row its copy."""
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(s.context), len(distinct)) for s in rows]
        contexts = list(distinct)
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, width - len(ctx):] = torch.tensor(ctx)
            mask[i, width - len(ctx):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the host, moved once
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :]
        self.prefilled_rows += len(rows)
        self.prefilled_contexts += len(contexts)
        if len(contexts) < len(rows):
            index = torch.tensor(row_of, device=self.device)
            cache.batch_select_indices(index)
            mask, positions, logits = mask[index], positions[index], logits[index]
        return cache, mask, positions[:, -1], logits

    # decode + admit -----------------------------------------------------------------------------------------
    def _can_extend(self, step: Step) -> bool:
        """Rows can be kept and merged only in a plain per-layer KV cache (no sliding windows, no states)."""
        layers = self._cache.layers if self._cache is not None else []
        return (bool(layers) and self._mask is not None and bool(step.keep) and max(step.keep) < self._mask.shape[0]
                and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers))

    def _extend(self, step: Step) -> torch.Tensor:
        if step.keep != tuple(range(self._mask.shape[0])):
            self._select(torch.tensor(step.keep, device=self.device))
        logits = [self._decode()]
        if step.new:
            cache, mask, positions, new_logits = self._prefill(step.rows[len(step.keep):])
            self._merge(cache, mask, positions)
            logits.append(new_logits)
        return torch.cat(logits)

    def _decode(self) -> torch.Tensor:
        rows = self._mask.shape[0]
        self._mask = torch.cat([self._mask, torch.ones((rows, 1), dtype=torch.long, device=self.device)], dim=-1)
        self._positions = self._positions + 1
        out = self.model(input_ids=self._last.unsqueeze(-1), attention_mask=self._mask,
                         position_ids=self._positions.unsqueeze(-1), cache=self._cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1, :]

    def _select(self, keep: torch.Tensor) -> None:
        """Keep these rows, then drop the KV columns that are padding in every row left."""
        self._cache.batch_select_indices(keep)
        self._mask, self._positions, self._last = self._mask[keep], self._positions[keep], self._last[keep]
        start = int(self._mask.any(dim=0).long().argmax())
        if start:
            self._mask = self._mask[:, start:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def _merge(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Append prefilled rows to the cache; the narrower side is left-padded (masked) to the common width."""
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask = torch.cat([F.pad(self._mask, (width - self._mask.shape[1], 0)), F.pad(mask, (width - mask.shape[1], 0))])
        self._positions = torch.cat([self._positions, positions])


def _left_pad(kv: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, time, dim] -> zeros on the left of the time axis up to `width`."""
    return F.pad(kv, (0, 0, width - kv.shape[-2], 0))
