"""Model forwards on training batches: logits, per-token log-probs, no-grad evaluation. Torch only.

Padded by default; inside ``packing.packed_forwards(PackingConfig(enabled=True))`` the rows are packed (no pad
tokens through the model) and the results put back on the same [B, L-1] grid. Packed, the log-prob functions
compute the vocabulary projection only where ``loss_mask`` is set (the only cells any objective reads) and
leave 0 elsewhere; ``sequence_logits`` fills every real position and leaves 0 past each row's end.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from services.common.hf_models import image_embeds
from services.common.moe_routing import replaying
from services.trainer.algorithms import token_logp
from services.trainer.batching import PackedBatch
from services.trainer.optim import Clip, apply_update
from services.trainer.packing import active, pack_rows, packed_logits

# (rows of the minibatch or None for all, their log-probs, their entropies, each position's KL from the teacher's
# top-k or None) -> (loss, stats) of those rows
LossOf = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict[str, float]]]


@dataclasses.dataclass
class TeacherTopK:
    """A teacher's k likeliest next tokens at every position of a batch: ids long[B, L-1, k] and their log-probs
    float[B, L-1, k] at the training temperature (on-policy distillation's forward-KL term)."""
    ids: torch.Tensor
    logp: torch.Tensor

    def rows(self, index: torch.Tensor) -> TeacherTopK:
        return TeacherTopK(self.ids[index], self.logp[index])

    def at(self, cells: torch.Tensor) -> TeacherTopK:
        """The positions where ``cells`` (bool[B, L-1]) is set, [N, k] each."""
        return TeacherTopK(self.ids[cells], self.logp[cells])


def _packed_logits(model: torch.nn.Module, batch: PackedBatch, cells: torch.Tensor):
    """Logits float[N, V] of the grid cells where ``cells`` (bool[B, L-1]) is set, and those cells' (rows, cols)."""
    config = active()
    assert config is not None
    images = batch.image_group if batch.pixel_values is not None else None
    packing = pack_rows(batch.input_ids, batch.attention_mask, batch.lengths, config, image_group=images)
    rows, cols = torch.nonzero(cells, as_tuple=True)
    embeds = _input_embeds(model, batch)
    if embeds is not None:  # the grid's embeddings, images in place, laid out as the packed tokens
        embeds = embeds.reshape(-1, embeds.shape[-1])[packing.source.clamp(min=0)]
    with _replayed_routes(model, batch, packing.source):
        return packed_logits(model, packing, packing.locate(rows, cols), embeds), rows, cols


def _input_embeds(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor | None:
    """A vision-language batch's input embeddings float[B, L, H], each row's images in place; None for a text
    batch."""
    pixels = batch.pixel_values
    return None if pixels is None else image_embeds(model, batch.input_ids, pixels, batch.image_count)


def _replayed_routes(model: torch.nn.Module, batch: PackedBatch, source: torch.Tensor | None = None):
    """MoE routing replay for one forward of ``model`` over ``batch`` (its rows padded, or packed: ``source``,
    each packed cell's place on the grid): its routers take the rollout's recorded experts where the batch has
    them. Nothing when replay is off for the model or the batch carries no routes."""
    routers = replaying(model)
    if routers is None or batch.routes.shape[1] == 0:
        return contextlib.nullcontext()
    b, width = batch.input_ids.shape
    flat = batch.routes.reshape(b * width, *batch.routes.shape[2:])
    if source is not None:
        cells = source.reshape(-1)
        flat = torch.where((cells >= 0)[:, None, None], flat[cells.clamp(min=0)], -1)
    return routers.replay(flat)


def _on_grid(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    b, width = batch.input_ids.shape
    return values.new_zeros((b, width - 1, *values.shape[1:])).index_put((rows, cols), values)


def _trained_cells(batch: PackedBatch) -> torch.Tensor:
    return (batch.loss_mask != 0) & batch.attention_mask[:, 1:].bool()


def sequence_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """float[B, L-1, V]: position t predicts token t+1."""
    if active() is not None:
        logits, rows, cols = _packed_logits(model, batch, batch.attention_mask[:, 1:].bool())
        return _on_grid(logits, rows, cols, batch)
    embeds = _input_embeds(model, batch)
    tokens = {"input_ids": batch.input_ids} if embeds is None else {"inputs_embeds": embeds}
    with _replayed_routes(model, batch):
        out = model(**tokens, attention_mask=batch.attention_mask, use_cache=False)
    return out.logits[:, :-1, :]


def policy_logp(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    if active() is not None:
        cells = _trained_cells(batch)
        logits, rows, cols = _packed_logits(model, batch, cells)
        return _on_grid(token_logp(logits, batch.input_ids[:, 1:][cells], temperature), rows, cols, batch)
    return token_logp(sequence_logits(model, batch), batch.input_ids[:, 1:], temperature)


def logits_token_terms(logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy_grad: bool,
                       teacher: TeacherTopK | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels``, entropies and, with a ``teacher``, the KL from the teacher to the student over the
    teacher's k likeliest tokens and one bucket for all the others, all from one log-softmax. The bucket makes it
    the exact KL of the two distributions coarsened the same way: 0, with no gradient, where the student equals
    the teacher (renormalising over the k would push even an equal student to drop its tail). The entropy keeps
    no vocabulary-sized graph unless ``entropy_grad``; the KL keeps its gradient (it is a loss term)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logprobs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    kl = None
    if teacher is not None:
        if teacher.ids.shape[-1] >= logits.shape[-1]:
            raise ValueError(f"distill_topk: {teacher.ids.shape[-1]} tokens, the vocabulary has {logits.shape[-1]}: "
                             "take fewer (the rest of the vocabulary is one bucket)")
        theirs, mine = teacher.logp.float(), logprobs.gather(-1, teacher.ids)
        rest = (1 - theirs.exp().sum(-1)).clamp(min=0)
        # the student's rest from its own log-probs, not 1 - sum: a peaked student's rest (1e-7 and less) is below
        # float32's rounding of that difference, and its log would be noise with a large gradient
        mine_rest = logprobs.scatter(-1, teacher.ids, float("-inf")).logsumexp(-1)
        kl = (theirs.exp() * (theirs - mine)).sum(-1) + torch.xlogy(rest, rest) - rest * mine_rest
    return logp, entropy, kl


def logits_logp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                        entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logp, entropy, _ = logits_token_terms(logits, labels, temperature, entropy_grad)
    return logp, entropy


def token_terms(model: torch.nn.Module, batch: PackedBatch, temperature: float, *, entropy_grad: bool,
                teacher: TeacherTopK | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs, entropies and (with a ``teacher``) KLs from its top-k, float[B, L-1] each, from one
    forward and one log-softmax."""
    if active() is not None:
        cells = _trained_cells(batch)
        logits, rows, cols = _packed_logits(model, batch, cells)
        logp, entropy, kl = logits_token_terms(logits, batch.input_ids[:, 1:][cells], temperature, entropy_grad,
                                               None if teacher is None else teacher.at(cells))
        return (_on_grid(logp, rows, cols, batch), _on_grid(entropy, rows, cols, batch),
                None if kl is None else _on_grid(kl, rows, cols, batch))
    return logits_token_terms(sequence_logits(model, batch), batch.input_ids[:, 1:], temperature, entropy_grad,
                              teacher)


def logp_and_entropy(model: torch.nn.Module, batch: PackedBatch, temperature: float, *,
                     entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies, float[B, L-1] each, from one forward and one log-softmax."""
    logp, entropy, _ = token_terms(model, batch, temperature, entropy_grad=entropy_grad)
    return logp, entropy


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """No grad and eval mode (no dropout) for the duration; the previous mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def frozen_logp(model: torch.nn.Module, batch: PackedBatch, temperature: float) -> torch.Tensor:
    """Per-token log-probs with no grad and no dropout, float[B, L-1]."""
    with evaluating(model):
        return policy_logp(model, batch, temperature)


def frozen_logp_and_topk(model: torch.nn.Module, batch: PackedBatch, temperature: float,
                         k: int) -> tuple[torch.Tensor, TeacherTopK]:
    """From one forward with no grad and no dropout: each token's log-prob, float[B, L-1], and the k likeliest next
    tokens at every position (0 past each row's end)."""
    with evaluating(model):
        logprobs = torch.log_softmax(sequence_logits(model, batch).float() / temperature, dim=-1)
        taken = logprobs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        top, ids = logprobs.topk(k, dim=-1)
    return taken, TeacherTopK(ids, top)


class Forwards:
    """How a training step runs the policy: here directly, one process computing whole rows' logits, the loss
    backpropagated by ``update``. A pipeline-parallel policy (``megatron/pipeline.py``) runs the same three calls
    through its stages."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def frozen_logp(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        return frozen_logp(self.model, batch, temperature)

    def loss(self, batch: PackedBatch, temperature: float, *, entropy_grad: bool, loss_of: LossOf,
             teacher: TeacherTopK | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``loss_of`` on every row of ``batch`` (one forward): the loss, still to be backpropagated, and stats.
        ``teacher``: the rows' top-k targets, for the forward-KL term of on-policy distillation."""
        logp, entropy, kl = token_terms(self.model, batch, temperature, entropy_grad=entropy_grad, teacher=teacher)
        return loss_of(None, logp, entropy, kl)

    def update(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float,
               schedule: torch.optim.lr_scheduler.LRScheduler | None, clip: Clip | None) -> dict[str, float]:
        return apply_update(self.model, optimizer, loss, grad_clip, schedule, clip)
