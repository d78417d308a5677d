"""A megatron-core GPTModel rank behind the interface the trainer's forwards use (a transformers causal LM's).

``MegatronCausalLM(gpt)(input_ids=..., attention_mask=...)`` returns ``.logits`` float[B, L, V]: the rank's
vocab-parallel columns gathered over the tensor-parallel group with megatron-core's own autograd mapping (its
backward hands each rank the gradient of its columns), padding columns dropped. Every objective, log-prob and
entropy function then runs unchanged, on every TP rank alike. The cost is the full vocabulary's logits on each
rank; ``megatron/loss.py`` computes log-probs without the gather, for when that memory matters.

Rows are right-padded (``batching.pack``), so the causal mask alone keeps every real position from seeing
padding; pad positions compute garbage that no objective reads.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist

from services.trainer.megatron.model import sequence_width


class MegatronCausalLM(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module, vocab_size: int, expert_group=None) -> None:
        """`expert_group`: with expert parallelism, the ranks whose tokens the MoE layers gather (megatron-core's
        expert tensor x model parallel group); their forwards are padded to one shape."""
        super().__init__()
        self.gpt = gpt
        self.vocab_size = vocab_size
        self.expert_group = expert_group
        self.routes = None  # MoE routing replay (megatron/routing.py): laid out for each forward's shape

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, use_cache: bool = False,
                **_) -> types.SimpleNamespace:
        rows, width = input_ids.shape
        shape = [rows, width]
        if self.expert_group is not None and dist.get_world_size(self.expert_group) > 1:
            # the all-gather token dispatcher needs equal shapes on every rank of the group
            reduced = torch.tensor(shape, device=input_ids.device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.expert_group)
            shape = reduced.tolist()
        shape[1] = sequence_width(self.gpt.config, shape[1])
        if self.routes is not None:
            from megatron.core import parallel_state as ps

            sp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()) \
                if self.gpt.config.sequence_parallel else None
            self.routes.lay_out(rows, width, shape, sp)
        if shape == [rows, width]:
            return types.SimpleNamespace(logits=self._logits(input_ids))
        # right padding: under the causal mask no real position sees it; its logits are dropped
        padded = input_ids.new_zeros(tuple(shape))
        padded[:rows, :width] = input_ids
        return types.SimpleNamespace(logits=self._logits(padded)[:rows, :width])

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        width = input_ids.shape[1]
        positions = torch.arange(width, device=input_ids.device).expand_as(input_ids)
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=input_ids.device), 1)[None, None]
        local = self.gpt(input_ids, positions, causal)   # [B, L, V_padded / tp]
        return gather_from_tensor_model_parallel_region(local)[..., :self.vocab_size]

    def get_input_embeddings(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(num_embeddings=self.vocab_size)


class ParallelGrads:
    """What megatron-core's ``finalize_model_grads`` and gradient clipping do, for a model without its DDP wrapper:
    the gradients averaged over the data-parallel group (each DP rank trained its share of the rows); the
    parameters every TP rank holds a copy of but sees only its heads of (``q_layernorm`` / ``k_layernorm``, and
    sequence-parallel norms) summed over the TP group, ``average_gradients_across_tp_domain`` ones averaged; with
    pipeline stages, the tied word embedding's two copies (first stage's input, last stage's output layer) summed
    over the embedding group, so both take the same update; then one norm of the whole model — TP shards and
    pipeline stages summed over the model-parallel group, copies counted once — so every rank clips by the same
    factor and the copies stay equal.

    Expert-parallel parameters (megatron-core marks them ``allreduce = False``) are held by the ranks of one expert
    data-parallel group only, and their gradients already hold every expert-group rank's rows (the all-gather
    dispatcher's backward reduce-scatters them back): summed over that group and divided by the whole
    data-parallel size, as megatron-core's DDP scales them; their squares count once per expert, summed over the
    expert tensor x model x pipeline parallel group."""

    def __init__(self, module: torch.nn.Module, config, tp_group, dp_group, *, model_group=None,
                 embedding_group=None, expert_dp_group=None, expert_model_group=None) -> None:
        """``model_group``: tp x pp (default: the tp group); ``embedding_group``: first and last stage, on those
        ranks when the embedding is tied and pp > 1; ``expert_model_group``: expert tp x ep x pp."""
        self.tp_group, self.dp_group = tp_group, dp_group
        self.model_group = model_group if model_group is not None else tp_group
        self.embedding_group = embedding_group
        self.expert_dp_group, self.expert_model_group = expert_dp_group, expert_model_group
        self.tp_sum, self.tp_mean = [], []
        self.experts = {id(p) for p in module.parameters() if not getattr(p, "allreduce", True)}
        self.tied = [p for p in module.parameters() if getattr(p, "shared_embedding", False)]
        assert not self.experts or expert_model_group is not None, "expert-parallel parameters need the expert groups"
        assert not self.tied or embedding_group is not None, "a tied embedding over stages needs the embedding group"
        for name, p in module.named_parameters():
            if getattr(p, "average_gradients_across_tp_domain", False):
                self.tp_mean.append(p)
            elif (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
                self.tp_sum.append(p)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        for p in self.tied:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.embedding_group)
        grads = [p for p in params if p.grad is not None]
        dense = [p for p in grads if id(p) not in self.experts]
        experts = [p for p in grads if id(p) in self.experts]
        dp = dist.get_world_size(self.dp_group)
        for members, group in ((dense, self.dp_group), (experts, self.expert_dp_group)):
            reduce = bool(members) and dist.get_world_size(group) > 1
            for p in members:
                if reduce:
                    dist.all_reduce(p.grad, group=group)
                if dp > 1:
                    p.grad.div_(dp)
        if dist.get_world_size(self.tp_group) > 1:
            for members, op in ((self.tp_sum, dist.ReduceOp.SUM), (self.tp_mean, dist.ReduceOp.AVG)):
                for p in members:
                    if p.grad is not None:
                        dist.all_reduce(p.grad, op=op, group=self.tp_group)
        device = grads[0].grad.device if grads else torch.device("cpu")
        counted = [p.grad for p in dense if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)]
        square = _squares(counted, device)
        dist.all_reduce(square, group=self.model_group)
        if self.experts:
            expert_square = _squares([p.grad for p in experts], device)
            dist.all_reduce(expert_square, group=self.expert_model_group)
            square = square + expert_square
        norm = square.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in grads:
            p.grad.mul_(coef.to(p.grad.dtype))
        return norm


@contextlib.contextmanager
def _nothing(*_, **__):
    yield


def allow_cpu_forward() -> None:
    """megatron-core's forward asks CUDA for the rotary table's device and forks a CUDA RNG state around
    attention dropout; with no CUDA device both raise. On a CPU rank (dropout is off in our configs) point the
    first at the CPU and make the fork a no-op. Called only when the trainer's device is the CPU."""
    from megatron.core.tensor_parallel import random as megatron_random

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    megatron_random.get_cuda_rng_tracker().fork = _nothing
    # tied embeddings move the shared weight with `.cuda()` before their all-reduce (pp > 1); stay on CPU
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return sum((g.float().square().sum() for g in grads), torch.zeros((), device=device))
