"""Sequence packing for the trainer's forwards: rows (prompt + completion, no padding) placed first-fit-decreasing
into bins of at most ``max_tokens`` tokens, each bin one row of the forward. With ``share_prompts``, rows that
start with the same prompt (a GRPO group) go in as that prompt once followed by each row's completion: a prompt
token's hidden state depends only on the prompt, so computing it once per group changes no result.

Attention follows a 4-D mask built here: a token sees the earlier tokens of its own row only (its prompt, shared
or not, and its own completion), and positions restart for each row. Transformers passes a 4-D mask through
unchanged (masking_utils._preprocess_mask_arguments), as a boolean for sdpa and an additive float for eager.
Results go back onto the padded [B, L-1] grid (see ``Packing.locate``). Torch only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule

from services.common.errors import FieldError


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    enabled: bool = False
    max_tokens: int = 256  # tokens per bin; attention is dense within a bin, so larger bins cost O(max_tokens^2)
    share_prompts: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise FieldError("max_tokens", f"must be >= 1, got {self.max_tokens}")


_ACTIVE: contextvars.ContextVar[PackingConfig | None] = contextvars.ContextVar("packing", default=None)


@contextlib.contextmanager
def packed_forwards(config: PackingConfig) -> Iterator[None]:
    """The trainer's forwards (services.trainer.forward) pack while inside, when ``config.enabled``."""
    token = _ACTIVE.set(config if config.enabled else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> PackingConfig | None:
    return _ACTIVE.get()


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices per bin, longest rows first; no bin holds more than max(budget, longest row) tokens (a row
    longer than the budget gets a bin of its own)."""
    if budget < 1:
        raise FieldError("budget", f"must be >= 1, got {budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[row]
        slot = next((b for b, free in enumerate(room) if free >= n), None)
        if slot is None:
            bins.append([row])
            room.append(budget - n)
        else:
            bins[slot].append(row)
            room[slot] -= n
    return bins


@dataclasses.dataclass
class Packing:
    """Where each row's tokens sit in the packed [bins, width] forward."""
    input_ids: torch.Tensor       # long[bins, width], pad tokens after each bin's last row
    position_ids: torch.Tensor    # long[bins, width], each row's own positions (0 on pads)
    attention: torch.Tensor       # bool[bins, 1, width, width], True where query (dim 2) may see key (dim 3)
    bin_of: torch.Tensor          # long[B]
    prompt_start: torch.Tensor    # long[B], column of the row's prompt in its bin (shared by a group)
    prompt_length: torch.Tensor   # long[B], tokens of the row taken from that prompt
    completion_start: torch.Tensor  # long[B], column of the rest of the row
    lengths: torch.Tensor         # long[B], real tokens of the row
    source: torch.Tensor          # long[bins, width], row * L + column of each cell's token on the [B, L] grid, -1 on pads
    forward_tokens: int           # non-pad tokens in the bins: the rows' real tokens less the prompts shared

    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def locate(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bin, column) in the packed forward of the grid cells (rows, cols)."""
        prompt = self.prompt_length[rows]
        column = torch.where(cols < prompt, self.prompt_start[rows] + cols, self.completion_start[rows] + cols - prompt)
        return self.bin_of[rows], column


def _units(input_ids: torch.Tensor, lengths: list[int], prompts: list[int], budget: int,
           share: bool, image_group: list[int]) -> list[tuple[int, list[int]]]:
    """(prompt length, rows) per packing unit: the rows of a unit share their first ``prompt length`` tokens (and
    their images: the same placeholder tokens over other pictures are another prompt). A group too long for one bin
    is split, each part with its own copy of the prompt."""
    if not share:
        return [(n, [i]) for i, n in enumerate(lengths)]
    groups: dict[tuple, list[int]] = {}
    for i, (row, p) in enumerate(zip(input_ids.tolist(), prompts, strict=True)):
        groups.setdefault((image_group[i], *row[:p]), []).append(i)
    units = []
    for key, rows in groups.items():
        prompt = len(key) - 1
        part, size = [], prompt
        for i in rows:
            rest = lengths[i] - prompt
            if part and size + rest > budget:
                units.append((prompt, part))
                part, size = [], prompt
            part.append(i)
            size += rest
        units.append((prompt, part))
    return units


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_lengths: torch.Tensor,
              config: PackingConfig, pad_token_id: int = 0, image_group: torch.Tensor | None = None) -> Packing:
    """Right-padded rows ([B, L], as batching.pack builds them) -> bins of at most ``config.max_tokens`` tokens
    (a longer unit gets a bin of its own). Laid out on the host in plain integers, copied with one gather and
    scatter per tensor, then moved to the rows' device. ``image_group``: long[B], rows share a prompt only within
    one group (a vision-language batch: the same images)."""
    device, input_ids, attention_mask = input_ids.device, input_ids.cpu(), attention_mask.cpu()
    lengths = attention_mask.sum(-1)
    steps = torch.arange(attention_mask.shape[1] + 1)
    assert bool((attention_mask.cumsum(-1) == steps[1:].clamp(max=lengths.unsqueeze(-1))).all()), "rows must be right-padded"
    length_of = lengths.tolist()
    prompts = (lengths - completion_lengths.cpu()).clamp(min=1).tolist()
    images = image_group.tolist() if image_group is not None else [0] * len(length_of)
    units = _units(input_ids, length_of, prompts, config.max_tokens, config.share_prompts, images)
    sizes = [p + sum(length_of[i] - p for i in rows) for p, rows in units]
    bins = first_fit_decreasing(sizes, config.max_tokens)
    width = max(sum(sizes[u] for u in b) for b in bins)
    # runs of consecutive tokens copied into the bins: a unit's prompt, then each of its rows' completions, as
    # (bin, column in the bin, length, source row, source column = first position, unit, row-part id or -1)
    segments, meta = [], [(0, 0, 0, 0)] * len(length_of)  # per row: bin, prompt start, length, rest start
    part = 0
    for b, members in enumerate(bins):
        at = 0
        for u in members:
            p, rows = units[u]
            segments.append((b, at, p, rows[0], 0, u, -1))
            pstart, at = at, at + p
            for i in rows:
                n = length_of[i] - p
                segments.append((b, at, n, i, p, u, part))
                meta[i] = (b, pstart, p, at)
                at, part = at + n, part + 1
    seg_bin, seg_start, seg_length, seg_row, seg_column, seg_unit, seg_sequence = torch.tensor(segments).unbind(-1)
    segment = torch.repeat_interleave(torch.arange(len(segments)), seg_length)  # per token: its segment
    offset = torch.arange(len(segment)) - (torch.cumsum(seg_length, 0) - seg_length)[segment]
    column = seg_column[segment] + offset
    cell = seg_bin[segment] * width + seg_start[segment] + offset
    ids = torch.full((len(bins) * width,), pad_token_id, dtype=input_ids.dtype)
    ids[cell] = input_ids[seg_row[segment], column]
    positions = torch.zeros(len(bins) * width, dtype=torch.long)
    positions[cell] = column
    sequence = torch.full((len(bins) * width,), -1, dtype=torch.long)  # a row-part's id; the prompt's is the unit's
    sequence[cell] = seg_sequence[segment]
    unit_of = torch.full((len(bins) * width,), -1, dtype=torch.long)
    unit_of[cell] = seg_unit[segment]
    source = torch.full((len(bins) * width,), -1, dtype=torch.long)
    source[cell] = seg_row[segment] * input_ids.shape[1] + column
    ids, positions, sequence, unit_of, source = (t.view(len(bins), width)
                                                 for t in (ids, positions, sequence, unit_of, source))
    rows_meta = torch.tensor(meta, dtype=lengths.dtype).reshape(len(length_of), 4).unbind(-1)
    pad = unit_of < 0
    unit_of[pad] = -1 - torch.arange(int(pad.sum()))  # each pad token its own unit: it sees itself only
    same_unit = unit_of.unsqueeze(-1) == unit_of.unsqueeze(-2)
    own_row = (sequence.unsqueeze(-2) < 0) | (sequence.unsqueeze(-1) == sequence.unsqueeze(-2))  # key is a prompt or the query's own
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    attention = (same_unit & own_row & causal).unsqueeze(1)
    out = [t.to(device) for t in (ids, positions, attention, *rows_meta, lengths, source)]
    return Packing(*out, forward_tokens=int((~pad).sum()))


def attention_mask_for(model: torch.nn.Module, packing: Packing) -> torch.Tensor:
    """The 4-D mask as the model's attention implementation takes it."""
    kind = model.config._attn_implementation
    if kind == "sdpa":
        return packing.attention
    if kind == "eager":
        return torch.zeros(packing.attention.shape, device=packing.attention.device).masked_fill(
            ~packing.attention, torch.finfo(torch.float32).min)
    raise FieldError("packing", f"attention implementation {kind!r} is not supported; use sdpa or eager")


def packed_logits(model: torch.nn.Module, packing: Packing, where: tuple[torch.Tensor, torch.Tensor],
                  embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Logits float[N, V] at the packed cells ``where`` = (bins, columns). The output projection runs on those
    cells only, unless the model is FSDP-sharded: then the root forward must run (it gathers the root's
    parameters) and projects every cell. ``embeds`` (float[bins, width, H]): the packed input embeddings, given
    instead of the tokens (a vision-language batch, images in place)."""
    tokens = {"input_ids": packing.input_ids} if embeds is None else {"inputs_embeds": embeds}
    kwargs = {**tokens, "position_ids": packing.position_ids,
              "attention_mask": attention_mask_for(model, packing), "use_cache": False}
    if isinstance(model, FSDPModule):
        return model(**kwargs).logits[where]
    hidden = model.get_decoder()(**kwargs).last_hidden_state
    return model.get_output_embeddings()(hidden[where])
