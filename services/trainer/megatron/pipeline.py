"""A step's forwards and backward through megatron-core's own pipeline schedules (pp > 1).

Each minibatch (this data-parallel rank's rows) is cut into ``microbatches`` equal microbatches and handed to
``get_forward_backward_func()`` — 1F1B without interleaving — which moves the activations between stages and runs
each microbatch's backward. On the last stage a microbatch's logits become log-probs and entropies and the loss of
its rows, weighted by their share of the minibatch's loss weight, so the microbatches' losses sum to the loss the
whole minibatch would have. The gradients are then where an un-pipelined backward leaves them; the loss, the
stats (and the no-grad log-probs) are broadcast from the last stage, so every rank continues the step alike.

Shapes: the schedule sends [length, rows, hidden] between stages, the same for every microbatch, and with expert
parallelism every rank of an expert group forwards the same shapes; so every rank pads to the world's largest
microbatch (rows and length). Padding rows and columns are never in a loss (a microbatch of padding only
contributes ``0 * logits.sum()``, which keeps its backward running).

On CPU, ``cpu_schedules()`` points the one tensor the schedules allocate on ``device="cuda"`` at the CPU, and
p2p goes one isend / irecv at a time (``batch_p2p_comm: False``: the batched path calls torch.cuda.synchronize);
everything else they do runs on gloo.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.batching import PackedBatch
from services.trainer.forward import Forwards, LossOf, TeacherTopK, logits_logp_entropy
from services.trainer.megatron.model import sequence_width
from services.trainer.optim import Clip, optimizer_step


class PipelineForwards(Forwards):
    def __init__(self, model: Any, *, microbatches: int, loss_weight) -> None:
        """``model``: a ``MegatronCausalLM`` (its ``gpt`` is this rank's stage); ``loss_weight``: the algorithm's
        weight of a set of rows' loss mask (``Algorithm.loss_weight``)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        super().__init__(model)
        self.gpt: Any = model.gpt
        self.vocab_size: int = model.vocab_size
        self.microbatches = microbatches
        self.loss_weight = loss_weight
        self.group = ps.get_pipeline_model_parallel_group()
        self.last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.is_last = ps.is_pipeline_last_stage()
        self.schedule = get_forward_backward_func()
        # the loss function returns (loss, tokens, data): with per-token loss on, the schedule neither divides the
        # loss by the microbatch count nor by the tokens (our loss is already weighted)
        self.gpt.config.calculate_per_token_loss = True
        if not torch.cuda.is_available():
            # batched p2p ends in torch.cuda.synchronize(); one isend / irecv at a time runs on gloo
            self.gpt.config.batch_p2p_comm = False
            cpu_schedules()

    # --- the three calls a step makes -------------------------------------------------------------------------
    def frozen_logp(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        micro, shape = self._microbatches(batch)

        def collect(_, logits, piece):
            logp, _ = logits_logp_entropy(logits, piece.input_ids[:, 1:], temperature, False)
            return logp

        was_training = self.gpt.training
        self.gpt.eval()
        try:
            with torch.no_grad():
                outputs = self._run(micro, shape, collect, forward_only=True)
        finally:
            self.gpt.train(was_training)
        out = torch.zeros(batch.size, batch.input_ids.shape[1] - 1, device=batch.input_ids.device)
        if self.is_last:
            out.copy_(torch.cat(outputs)[:batch.size, :out.shape[1]])
        dist.broadcast(out, src=self.last_rank, group=self.group)
        return out

    def loss(self, batch: PackedBatch, temperature: float, *, entropy_grad: bool, loss_of: LossOf,
             teacher: TeacherTopK | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward and backward of every microbatch; the gradients are accumulated when this returns."""
        assert teacher is None, "the trainer config refuses distill_topk with the megatron backend"
        micro, shape = self._microbatches(batch)
        total = max(self.loss_weight(batch.loss_mask), 1)

        length = batch.input_ids.shape[1] - 1

        def microbatch_loss(start, logits, piece):
            real = _real_rows(start, piece.input_ids.shape[0], batch.size)
            if real.numel() == 0:
                return logits.sum() * 0.0, None
            logp, entropy = logits_logp_entropy(logits[:real.numel(), :length], batch.input_ids[real, 1:],
                                                temperature, entropy_grad)
            loss, stats = loss_of(real, logp, entropy, None)
            weight = self.loss_weight(batch.loss_mask[real])
            return loss * (weight / total), (weight, float(loss.detach()) * weight / total, stats)

        for p in self.gpt.parameters():
            p.grad = None
        parts = self._run(micro, shape, microbatch_loss, forward_only=False)
        shared: list[Any] = [_combine(parts) if self.is_last else None]
        dist.broadcast_object_list(shared, src=self.last_rank, group=self.group)
        loss, stats = shared[0]
        return torch.tensor(loss, device=batch.input_ids.device), stats

    def update(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float,
               schedule: torch.optim.lr_scheduler.LRScheduler | None, clip: Clip | None) -> dict[str, float]:
        return optimizer_step(optimizer, grad_clip, schedule, clip)

    # --- the schedule ---------------------------------------------------------------------------------------
    def _microbatches(self, batch: PackedBatch) -> tuple[list[tuple[int, Any]], tuple[int, int]]:
        """The batch cut into ``microbatches`` pieces of one [rows, length] agreed over the world, padded."""
        n = self.microbatches
        rows = -(-batch.size // n)
        agreed = torch.tensor([rows, batch.input_ids.shape[1]], device=batch.input_ids.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        rows, width = (int(v) for v in agreed.tolist())
        width = sequence_width(self.gpt.config, width)
        ids = batch.input_ids.new_zeros((rows * n, width))
        ids[:batch.size, :batch.input_ids.shape[1]] = batch.input_ids
        micro = [(i, types.SimpleNamespace(input_ids=ids[i * rows:(i + 1) * rows])) for i in range(n)]
        return micro, (rows, width)

    def _run(self, micro: list, shape: tuple[int, int], on_logits, *, forward_only: bool) -> list:
        """The schedule over ``micro``; on the last stage, what ``on_logits(start, logits, piece)`` returned for
        each microbatch (its first row, its logits, its padded ids), in order: the loss's data when training."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        rows, width = shape
        device = micro[0][1].input_ids.device
        positions = torch.arange(width, device=device).expand(rows, width)
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), 1)[None, None]
        vocab, store = self.vocab_size, []
        batches = iter(micro)

        def forward_step(data_iterator, model):
            index, piece = next(data_iterator)
            out = model(piece.input_ids, positions, causal)

            def reduce(output, non_loss_data=False):
                logits = gather_from_tensor_model_parallel_region(output)[..., :vocab][:, :-1]
                result = on_logits(index * rows, logits, piece)
                if forward_only:
                    store.append(result)
                    return result
                loss, data = result
                store.append(data)
                return loss, torch.tensor(1, dtype=torch.int), {}

            # between stages the activations travel in float32 (the schedule's receive buffers), whatever autocast did
            return (out if self.is_last else out.float()), reduce

        self.schedule(forward_step_func=forward_step, data_iterator=batches, model=[self.gpt],
                      num_microbatches=len(micro), seq_length=width, micro_batch_size=rows,
                      forward_only=forward_only, collect_non_loss_data=forward_only)
        return store


def _real_rows(start: int, rows: int, size: int) -> torch.Tensor:
    """The minibatch rows a microbatch of ``rows`` rows starting at row ``start`` holds (none: all padding)."""
    return torch.arange(start, max(start, min(start + rows, size)))


def _combine(parts: list) -> tuple[float, dict[str, float]]:
    """The minibatch's loss (the sum of the weighted microbatch losses) and stats: ``*_max`` by max, the rest
    weighted by each microbatch's loss weight."""
    real = [p for p in parts if p is not None]
    loss = sum(part_loss for _, part_loss, _ in real)
    total = max(sum(w for w, _, _ in real), 1e-12)
    stats: dict[str, float] = {}
    for weight, _, part in real:
        for key, value in part.items():
            if key.endswith("_max"):
                stats[key] = max(stats.get(key, value), value)
            else:
                stats[key] = stats.get(key, 0.0) + weight * value / total
    return float(loss), stats


def cpu_schedules() -> None:
    """megatron-core's schedules count tokens in ``torch.zeros([], device="cuda")``; on a host without CUDA
    that raises before the first microbatch. Give its module a ``torch`` whose ``zeros`` puts "cuda" on the CPU
    (everything else is torch itself)."""
    from megatron.core.pipeline_parallel import schedules

    if isinstance(schedules.torch, _HostTorch):
        return
    schedules.torch = _HostTorch()


class _HostTorch(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
