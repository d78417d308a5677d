"""Per-token log-probs and entropies from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for vocab columns [rank * V/tp, (rank+1) * V/tp). Three all-reduces of
float[B, T] (max, sum of exp, target logit) give log softmax(logits / T)[target] on every rank. The backward is
local, as in Megatron's vocab-parallel cross entropy: every TP rank computes the same loss, so the gradient for a
rank's columns is (onehot - softmax) * grad / T with no further reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from services.common.errors import FieldError


class _VocabParallelLogp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, vocab_start: int,
                vocab_size: int | None) -> torch.Tensor:
        width = logits.shape[-1]
        logits = _mask_padding(logits, vocab_start, vocab_size)   # padding columns are not tokens
        top = logits.max(dim=-1).values
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local = targets - vocab_start
        mine = (local >= 0) & (local < width)
        picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(mine, picked, 0.0)
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(exp, sum_exp, local, mine)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, sum_exp, local, mine = ctx.saved_tensors
        width = exp.shape[-1]
        onehot = torch.nn.functional.one_hot(local.clamp(0, width - 1), width) * mine.unsqueeze(-1)
        grad_logits = (onehot - exp / sum_exp.unsqueeze(-1)) * grad.unsqueeze(-1)
        return grad_logits, None, None, None, None


def _mask_padding(logits: torch.Tensor, vocab_start: int, vocab_size: int | None) -> torch.Tensor:
    width = logits.shape[-1]
    if vocab_size is None or vocab_start + width <= vocab_size:
        return logits
    cols = torch.arange(vocab_start, vocab_start + width, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, float("-inf"))


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log Z - E_p[x]; dH/dx_j = -p_j (x_j - E_p[x]) (local, like the log-prob's backward)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group, vocab_start: int, vocab_size: int | None) -> torch.Tensor:
        logits = _mask_padding(logits, vocab_start, vocab_size)
        top = logits.max(dim=-1).values
        dist.all_reduce(top, dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        shifted = torch.where(exp > 0, shifted, 0.0)   # padding: -inf * 0 would be NaN
        sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])
        dist.all_reduce(sums, group=group)
        mean = sums[1] / sums[0]
        ctx.save_for_backward(exp, shifted, sums[0], mean)
        return sums[0].log() - mean

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, shifted, sum_exp, mean = ctx.saved_tensors
        probs = exp / sum_exp.unsqueeze(-1)
        return -probs * (shifted - mean.unsqueeze(-1)) * grad.unsqueeze(-1), None, None, None


def vocab_parallel_entropy(logits_shard: torch.Tensor, tp_group=None, temperature: float = 1.0,
                           vocab_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(full_logits / temperature) per position, float32 [..., T] (differentiable, for an
    entropy bonus); arguments as `vocab_parallel_logp`."""
    if temperature <= 0:
        raise FieldError("temperature", f"must be positive, got {temperature}")
    start = dist.get_rank(group=tp_group) * logits_shard.shape[-1]
    scaled = logits_shard.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return _VocabParallelEntropy.apply(scaled, tp_group, start, vocab_size)


def vocab_parallel_logp(logits_shard: torch.Tensor, targets: torch.Tensor, tp_group=None, temperature: float = 1.0,
                        vocab_size: int | None = None) -> torch.Tensor:
    """log softmax(full_logits / temperature)[targets], float32 [..., T], from this rank's [..., T, V/tp] columns.

    `tp_group`: the tensor-parallel process group (None: the default group). `vocab_size`: the real vocabulary;
    columns at or past it (Megatron's vocab padding) are excluded from the softmax.
    """
    if temperature <= 0:
        raise FieldError("temperature", f"must be positive, got {temperature}")
    if logits_shard.shape[:-1] != targets.shape:
        raise FieldError("targets", f"shape {tuple(targets.shape)} does not match logits {tuple(logits_shard.shape)}")
    rank = dist.get_rank(group=tp_group)
    start = rank * logits_shard.shape[-1]
    scaled = logits_shard.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    return _VocabParallelLogp.apply(scaled, targets, tp_group, start, vocab_size)
