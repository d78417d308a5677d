"""Runs a Hugging Face causal LM over the scheduler's steps: a full prefill, or a decode of the kept rows plus a
prefill of the admitted ones merged into the same left-padded KV cache.

The KV cache's layers keep spare columns on the right (`SlackLayer`): a decode step writes its token into them
instead of copying the whole cache into a new tensor (DynamicLayer's torch.cat), which cost O(context) per layer
and step; the buffer is reallocated (with room to grow) only when it is full or the rows changed.

On CPU every nn.Linear (the LM head included) runs on a oneDNN-prepacked copy of its weight (`PackedLinears`):
at a decode step's few rows a matmul is bound by reading its weight, and the plain path re-lays the weight out on
every call. bf16 weights on a CPU without native bf16 get float32 copies and the matmul runs in float32 (the
"packed-float32" path, chosen at build: `linear_path`): oneDNN refuses bf16 packing there, and torch's emulated
bf16 matmul is ~4-5x slower than float32 at 16-256 rows (`services/common/cpu_features.py`). The parameters stay the model's own tensors (the weight sync writes into them); every layer repacks
its copy on its next call after `weights_changed()` (the engine's `resume(version)`: the weight sync may land
bytes straight in the parameters' memory, which no version counter sees), and a layer does so by itself when its
weight changed through torch in place (the tensor's version counter moved) or was replaced.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from services.common.cpu_features import native_bf16, onednn_linear
from services.common.hf_models import image_embeds
from services.common.moe_routing import routers_of
from services.rollout.engines.prefix_cache import PrefixCache
from services.rollout.engines.sampler import sample
from services.rollout.engines.scheduler import Step
from services.rollout.engines.sequence import Sequence, Status

SLACK = 64  # spare KV columns allocated beyond what a layer holds (and at least half its length)


class Scored(NamedTuple):
    """A scored context: each token's log-prob from the second on, and at each of those positions the likeliest
    tokens' ids and log-probs (empty lists unless asked for)."""
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


SCORE_TOKENS = 2048  # (padded) tokens per scoring forward: its logits are that many vocabulary-wide rows


class SlackLayer(DynamicLayer):
    """A DynamicLayer whose keys / values are views of larger buffers: appending writes in place. Anything that
    replaces `keys` / `values` (row selection, trimming, merging) is fine: the next update sees they are no longer
    a prefix of the buffers and copies them into new ones."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        t, n = self.keys.shape[-2], key_states.shape[-2]
        if not (_prefix_of(self.keys, self._kbuf) and _prefix_of(self.values, self._vbuf)
                and t + n <= self._kbuf.shape[-2]):
            self._kbuf = _grow(self.keys, t + n)
            self._vbuf = _grow(self.values, t + n)
        self._kbuf[:, :, t:t + n].copy_(key_states)
        self._vbuf[:, :, t:t + n].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, :t + n], self._vbuf[:, :, :t + n]
        return self.keys, self.values


def _prefix_of(view: torch.Tensor, buf: torch.Tensor | None) -> bool:
    return (buf is not None and view.data_ptr() == buf.data_ptr() and view.shape[:2] == buf.shape[:2]
            and view.shape[-1] == buf.shape[-1] and view.stride() == buf.stride() and view.dtype == buf.dtype)


def _grow(kv: torch.Tensor, need: int) -> torch.Tensor:
    rows, heads, t, dim = kv.shape
    buf = kv.new_empty((rows, heads, need + max(SLACK, need // 2), dim))
    buf[:, :, :t].copy_(kv)
    return buf


LINEAR_PATHS = ("packed", "packed-float32", "plain")


def linear_path(dtype: torch.dtype, device: torch.device, prepack: bool) -> str:
    """How the engine's linears run here: "packed" (oneDNN-prepacked copies in the weights' dtype),
    "packed-float32" (bf16 weights on a CPU without native bf16: float32 prepacked copies, the matmul in float32,
    the result cast back to bf16) or "plain" (torch's own nn.Linear: off CPU, or `prepack` off)."""
    if not prepack or device.type != "cpu" or not onednn_linear():
        return "plain"
    if dtype == torch.bfloat16 and not native_bf16():
        return "packed-float32"
    return "packed"


class PackedLinears:
    """oneDNN-prepacked weights for the model's CPU nn.Linear layers (float32 / bfloat16), set as each layer's
    instance `forward`; `unpack()` restores the plain layers. Costs a second copy of those weights (twice their
    bytes with `compute=torch.float32` over bf16 weights: the copies, and the matmuls, are float32)."""

    def __init__(self, model: torch.nn.Module, compute: torch.dtype | None = None) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and _packable(m.weight)]
        for m in self.layers:
            m.forward = functools.partial(_packed_forward, m, [None, None], compute)

    def invalidate(self) -> None:
        """The weights changed behind torch's back: every layer repacks on its next call."""
        for m in self.layers:
            m.forward.args[1][0] = None

    def repack(self) -> None:
        """Pack every layer now (the engine does it lazily, layer by layer, in its next step)."""
        for m in self.layers:
            state = m.forward.args[1]
            w = m.weight
            state[1] = _pack(w, m.forward.args[2])
            state[0] = (w.data_ptr(), w._version, w.dtype)

    def unpack(self) -> None:
        for m in self.layers:
            m.__dict__.pop("forward", None)
        self.layers = []


def _packable(w: torch.Tensor) -> bool:
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or w.dim() != 2:
        return False
    try:
        w._version  # noqa: B018 - inference tensors have no version counter: changes could not be seen
    except RuntimeError:
        return False
    return True


def _pack(w: torch.Tensor, compute: torch.dtype | None) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(compute or w.dtype))


def _packed_forward(m: torch.nn.Linear, state: list, compute: torch.dtype | None, x: torch.Tensor) -> torch.Tensor:
    w = m.weight
    key = (w.data_ptr(), w._version, w.dtype)
    if state[0] != key:  # first call, or the weight changed since it was packed
        state[1] = _pack(w, compute)
        state[0] = key
    if compute is None or compute == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), state[1], m.bias, "none", [], "")
    bias = m.bias.to(compute) if m.bias is not None else None
    out = torch.ops.mkldnn._linear_pointwise(x.to(compute).contiguous(), state[1], bias, "none", [], "")
    return out.to(x.dtype)


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, pad_token_id: int, seed: int, prepack: bool = True,
                 prefix_cache_bytes: int = 0, record_routes: bool = False) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device  # every tensor of the engine lives here
        params = next(model.parameters())
        self.linear_path = linear_path(params.dtype, self.device, prepack)
        compute = torch.float32 if self.linear_path == "packed-float32" else None
        self.packed = PackedLinears(model, compute) if self.linear_path != "plain" else None
        self.pad_token_id = pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None       # [rows, kv width], 0 on each row's left padding
        self._positions: torch.Tensor | None = None  # [rows], position of each row's last token
        self._last: torch.Tensor | None = None       # [rows], each row's last sampled token
        self.prefilled_rows = 0                      # rows whose whole context went through the model
        self.prefilled_contexts = 0                  # ... counted once per distinct context (shared prompts)
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        # MoE routing replay: each row's routers' choices for every token it fed (Sequence.routes)
        self.routers = routers_of(model) if record_routes else None

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

    @torch.inference_mode()
    def score(self, contexts: list[list[int]], temperature: float, top: int = 0) -> list[Scored]:
        """Each context's token log-probs under the model (token t given tokens < t, softmax(logits / temperature);
        the first token has none) and, with ``top``, the ``top`` likeliest tokens at each of those positions:
        left-padded forwards of at most SCORE_TOKENS tokens, outside the generation's KV cache (a long batch is not
        one vocabulary-wide tensor)."""
        out: list[Scored] = []
        start = 0
        while start < len(contexts):
            width, end = len(contexts[start]), start + 1
            while end < len(contexts) and max(width, len(contexts[end])) * (end + 1 - start) <= SCORE_TOKENS:
                width, end = max(width, len(contexts[end])), end + 1
            out += self._score(contexts[start:end], temperature, top)
            start = end
        return out

    def _score(self, contexts: list[list[int]], temperature: float, top: int) -> list[Scored]:
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, width - len(ctx):] = torch.tensor(ctx)
            mask[i, width - len(ctx):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        logprobs = torch.log_softmax(logits[:, :-1].float() / max(temperature, 1e-4), dim=-1)
        taken = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
        if not top:
            return [Scored(taken[i, width - len(c):].tolist(), [], []) for i, c in enumerate(contexts)]
        best, best_ids = (t.cpu() for t in logprobs.topk(top, dim=-1))
        return [Scored(taken[i, width - len(c):].tolist(), best_ids[i, width - len(c):].tolist(),
                       best[i, width - len(c):].tolist()) for i, c in enumerate(contexts)]

    def drop_cache(self) -> None:
        self._cache = None

    def weights_changed(self) -> None:
        """The parameters were written (in place, possibly as raw bytes): derived copies are rebuilt before use."""
        if self.packed is not None:
            self.packed.invalidate()
        if self.prefix is not None:
            self.prefix.clear()  # KV computed under the old weights

    # full prefill -------------------------------------------------------------------------------------------
    def _full(self, rows: list[Sequence]) -> torch.Tensor:
        self._cache, self._mask, self._positions, logits = self._prefill(rows)
        return logits

    def _prefill(self, rows: list[Sequence]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run each distinct context once (the samples of one prompt share it), then give every row its copy.
        With a prefix cache, contexts that start with a stored prefix compute only the rest (grouped by the
        prefix's length, so each group is one batch), and each context's own prefix is stored afterwards."""
        distinct: dict[tuple, int] = {}
        row_of = [distinct.setdefault(s.context_key, len(distinct)) for s in rows]
        first: dict[int, Sequence] = {}
        for seq, c in zip(rows, row_of, strict=True):
            first.setdefault(c, seq)
        contexts = [tuple(first[c].context) for c in range(len(first))]
        images = [first[c].images for c in range(len(first))]
        groups: dict[int, list[int]] = {}   # cached prefix length -> contexts
        prefixes: list[list | None] = [None] * len(contexts)
        prefix_routes: list[torch.Tensor | None] = [None] * len(contexts)
        for i, ctx in enumerate(contexts):
            # a context with images is never looked up nor stored: its tokens alone do not name its KV
            cached = self.prefix is not None and images[i] is None
            hit, prefixes[i], prefix_routes[i] = self.prefix.lookup(ctx) if cached else (0, None, None)
            groups.setdefault(hit, []).append(i)
        routes: list[torch.Tensor | None] = [None] * len(contexts)
        parts = []
        for hit, members in groups.items():
            with self._recording() as recording:
                parts.append(self._forward([contexts[i] for i in members], hit, [prefixes[i] for i in members],
                                           [images[i] for i in members]))
            if recording is not None:
                for i, r in zip(members, self._context_routes(recording, [contexts[i] for i in members], hit,
                                                             [prefix_routes[i] for i in members]), strict=True):
                    routes[i] = r
        order = [i for members in groups.values() for i in members]
        cache, mask, positions, logits = parts[0] if len(parts) == 1 else _concat(parts)
        for layer in cache.layers:  # plain layers grow in place from now on
            if type(layer) is DynamicLayer:
                layer.__class__ = SlackLayer
        if self.prefix is not None and not all(type(layer) is SlackLayer for layer in cache.layers):
            self.prefix = None  # sliding windows or recurrent states: a prefix's KV is not a plain per-layer slice
        if self.prefix is not None:
            for slot, i in enumerate(order):
                if images[i] is None:
                    self.prefix.insert(contexts[i], functools.partial(_row_kv, cache, mask, slot), routes[i])
        if self.routers is not None:
            for seq, c in zip(rows, row_of, strict=True):
                seq.routes = [routes[c]]  # a prefill computes every position again: earlier records are replaced
        self.prefilled_rows += len(rows)
        self.prefilled_contexts += len(contexts)
        slot_of = {i: slot for slot, i in enumerate(order)}
        index = [slot_of[c] for c in row_of]
        if index != list(range(len(order))):
            index_t = torch.tensor(index, device=self.device)
            cache.batch_select_indices(index_t)
            mask, positions, logits = mask[index_t], positions[index_t], logits[index_t]
        return cache, mask, positions, logits

    def _forward(self, contexts: list[tuple[int, ...]], hit: int, prefixes: list, images: list) -> tuple:
        """One batch through the model: each context's tokens after its first `hit` (whose KV `prefixes` holds),
        left-padded to a common width; the KV columns are [prefix | padding | rest], the mask 0 on the padding.
        The contexts' images (a vision-language model) go in as one pixel batch, in row order, each image's features
        at its placeholders (image_embeds), which are in that order."""
        width = max(len(c) for c in contexts) - hit
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), hit + width), dtype=torch.long)
        mask[:, :hit] = 1
        for i, ctx in enumerate(contexts):
            rest = len(ctx) - hit
            ids[i, width - rest:] = torch.tensor(ctx[hit:])
            mask[i, hit + width - rest:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the host, moved once
        positions = ((mask.cumsum(-1) - 1).clamp(min=0))[:, hit:]
        if hit:
            layers = zip(*prefixes, strict=True)  # per layer: every context's (keys, values)
            cache = DynamicCache(ddp_cache_data=[(torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv]))
                                                 for kv in layers])
        else:
            cache = DynamicCache()
        pixels = [im.pixel_values for im in images if im is not None]
        if pixels:  # the prompts' placeholders take their images' features (sampled placeholders stay tokens)
            count = torch.tensor([0 if im is None else len(im.key) for im in images])
            tokens = {"inputs_embeds": image_embeds(self.model, ids, torch.cat(pixels).to(self.device), count)}
        else:
            tokens = {"input_ids": ids}
        out = self.model(**tokens, attention_mask=mask, position_ids=positions,
                         cache=cache, use_cache=True, logits_to_keep=1)
        return cache, mask, positions[:, -1], out.logits[:, -1, :]

    # decode + admit -----------------------------------------------------------------------------------------
    def _can_extend(self, step: Step) -> bool:
        """Rows can be kept and merged only in a plain per-layer KV cache (no sliding windows, no states)."""
        layers = self._cache.layers if self._cache is not None else []
        return (bool(layers) and self._mask is not None and bool(step.keep) and max(step.keep) < self._mask.shape[0]
                and all(type(layer) in (DynamicLayer, SlackLayer) and layer.is_initialized for layer in layers))

    def _extend(self, step: Step) -> torch.Tensor:
        if step.keep != tuple(range(self._mask.shape[0])):
            self._select(torch.tensor(step.keep, device=self.device))
        logits = [self._decode(step.rows[:len(step.keep)])]
        if step.new:
            cache, mask, positions, new_logits = self._prefill(step.rows[len(step.keep):])
            self._merge(cache, mask, positions)
            logits.append(new_logits)
        return torch.cat(logits)

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        rows = self._mask.shape[0]
        self._mask = torch.cat([self._mask, torch.ones((rows, 1), dtype=torch.long, device=self.device)], dim=-1)
        self._positions = self._positions + 1
        with self._recording() as recording:
            out = self.model(input_ids=self._last.unsqueeze(-1), attention_mask=self._mask,
                             position_ids=self._positions.unsqueeze(-1), cache=self._cache, use_cache=True,
                             logits_to_keep=1)
        if recording is not None:
            fed = _stacked(recording)  # [rows, layers, top_k]: the token each row fed
            for r, seq in enumerate(seqs):
                if seq.status is Status.RUNNING:
                    seq.routes.append(fed[r:r + 1])
        return out.logits[:, -1, :]

    # routing replay ---------------------------------------------------------------------------------------------
    def _recording(self):
        return self.routers.record() if self.routers is not None else contextlib.nullcontext()

    def _context_routes(self, recording: list[list[torch.Tensor]], contexts: list[tuple[int, ...]], hit: int,
                        prefix_routes: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Per context of one `_forward` batch: its routes [len(context), layers, top_k], the cached prefix's
        (stored with its KV) followed by those of the tokens this batch fed (the right end of each padded row)."""
        fed = _stacked(recording).view(len(contexts), -1, self.routers.layers, self.routers.top_k)
        out = []
        for i, ctx in enumerate(contexts):
            rest = fed[i, fed.shape[1] - (len(ctx) - hit):]
            if hit and prefix_routes[i] is None:  # stored before recording was on: cannot happen in one engine
                raise RuntimeError("routing replay: a cached prefix without its routed experts")
            out.append(torch.cat([prefix_routes[i], rest]) if hit else rest)
        return out

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


def _concat(parts: list[tuple]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batches of one prefill as one: rows stacked, each left-padded (masked) to the widest."""
    width = max(mask.shape[1] for _, mask, _, _ in parts)
    cache = parts[0][0]
    for layer_idx, layer in enumerate(cache.layers):
        layer.keys = torch.cat([_left_pad(p[0].layers[layer_idx].keys, width) for p in parts])
        layer.values = torch.cat([_left_pad(p[0].layers[layer_idx].values, width) for p in parts])
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for _, m, _, _ in parts])
    return cache, mask, torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts])


def _row_kv(cache: DynamicCache, mask: torch.Tensor, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the KV of `row`'s first n tokens (its unmasked columns), for the prefix cache."""
    cols = mask[row].nonzero().squeeze(-1)[:n]
    return [(layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols)) for layer in cache.layers]


def _stacked(recording: list[list[torch.Tensor]]) -> torch.Tensor:
    """One forward's recorded indices, per layer [tokens, top_k] -> uint8/int16 [tokens, layers, top_k] on the host."""
    indices = torch.stack([layer[-1] for layer in recording], dim=1)
    return indices.to("cpu", torch.int16)


def _left_pad(kv: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, time, dim] -> zeros on the left of the time axis up to `width`."""
    return F.pad(kv, (0, 0, width - kv.shape[-2], 0))
