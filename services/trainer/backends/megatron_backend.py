"""The ``megatron`` backend: the policy as megatron-core GPTModel ranks (tensor parallel over ``megatron.tp``
ranks, pipeline stages over ``megatron.pp``, data parallel over the rest; a MoE model's experts split over
``megatron.ep`` ranks, each expert's matrices over ``megatron.etp``; a MoE model under tensor parallelism runs
megatron-core's sequence parallelism, which it requires there). pp = 1: each minibatch's forward and backward run on the model directly; pp > 1: through
megatron-core's own 1F1B schedule (``megatron/pipeline.py``); both on CPU (gloo) or CUDA/NPU. With ep > 1 the MoE
layers gather every expert-group rank's tokens (megatron-core's all-gather dispatcher: its all-to-all one needs
CUDA streams), so those ranks forward equal shapes and their expert gradients are reduced as megatron-core's DDP
does (``ParallelGrads``). Everything above the forward — the algorithms, minibatches, data-parallel row shares
(``shards.RowShards`` over the DP group) — is the torch backend's; the model answers as a causal LM
(``megatron/causal_lm.py``), and the gradient clip reduces over the ranks.

Weights: each rank loads its shards of the HF checkpoint (``megatron/convert.py``, the layout the weight exchange
uses). Rank 0 gathers them into a transformers model of the same checkpoint, whose tensors are what ``weights()``
returns and what checkpoints write: after every step when rank 0 alone feeds the weight sync, only before a
checkpoint with ``shard_sync`` (each rank sends its own shards). A resumable checkpoint also holds megatron-core's
distributed checkpoint of every rank's model and optimizer shards (``megatron/dist_checkpoint.py``): each rank
writes its own, and a trainer of another layout resumes from it.
"""

from __future__ import annotations

import os
import pathlib
import uuid
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from services.common.device import host_copy
from services.common.errors import FieldError
from services.common.hf_models import is_vision_language
from services.trainer.backends import group
from services.trainer.backends.shards import RowShards
from services.trainer.backends.torch_backend import TorchBackend, check_written_for
from services.trainer.checkpoint import read_state, save_checkpoint
from services.trainer.config import TrainerConfig


class MegatronBackend(TorchBackend):
    def __init__(self, config: TrainerConfig) -> None:
        from megatron.core import parallel_state as ps

        from services.weight_exchange.client.layouts.model import model_spec
        from services.weight_exchange.client.layouts.topology import megatron_parallel, parse_side

        if is_vision_language(config.model_path):
            raise FieldError("backend", "megatron does not train vision-language models yet; use backend torch")
        self.owns_group = group.join(config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        m = config.megatron
        ps.initialize_model_parallel(tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp,
                                     expert_model_parallel_size=m.ep, expert_tensor_parallel_size=m.expert_tp)
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        self.spec = model_spec(config.model_path)
        self.side = parse_side(m.side(self.world), "megatron")
        # uneven pipeline stages by the weight exchange's rule, which the GPTModel is then built to
        self.stages = megatron_parallel(self.side, self.rank, self.spec.num_layers).layers_per_stage
        self.hf: torch.nn.Module | None = None  # rank 0: the gathered weights, as a transformers model
        self.gather_every_step = not config.shard_sync
        super().__init__(config)
        from services.trainer.megatron.causal_lm import ParallelGrads

        tied = m.pp > 1 and self.spec.tie_word_embeddings and ps.is_rank_in_embedding_group()
        self.grads = ParallelGrads(self.model.gpt, self.model.gpt.config, self.tp_group, self.dp_group,
                                   model_group=ps.get_model_parallel_group(),
                                   embedding_group=ps.get_embedding_group() if tied else None,
                                   expert_dp_group=ps.get_expert_data_parallel_group(),
                                   expert_model_group=ps.get_expert_tensor_model_pipeline_parallel_group())
        if m.pp > 1:
            from services.trainer.megatron.pipeline import PipelineForwards

            self.forwards = PipelineForwards(self.model, microbatches=m.pipeline_microbatches,
                                             loss_weight=self.algo.loss_weight)
        self.shards = RowShards(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), self.device,
                                group=self.dp_group)
        self.gather_weights()

    def parallel(self):
        """This rank's coordinates (parallel_state's) and the pipeline's stages."""
        from services.trainer.megatron.model import current_parallel

        return current_parallel(layers_per_stage=self.stages)

    def resolve_device(self) -> torch.device:
        return group.rank_device(self.config.device)

    def load_policy(self) -> torch.nn.Module:
        from services.trainer.megatron.causal_lm import MegatronCausalLM, allow_cpu_forward
        from services.trainer.megatron.convert import canonical_state, hf_to_megatron
        from services.trainer.megatron.model import build_gpt_model

        if self.device.type == "cpu":
            allow_cpu_forward()
        hf = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=torch.float32)
        par = self.parallel()
        gpt = build_gpt_model(self.spec, par, moe_aux_loss_coeff=self.config.megatron.moe_aux_loss_coeff,
                              **_architecture(hf.config))
        gpt.load_state_dict(hf_to_megatron(canonical_state(hf.state_dict(), self.spec), self.spec, par), strict=True)
        if self.rank == 0:
            self.hf = hf.train()
        from megatron.core import parallel_state as ps

        experts = ps.get_expert_tensor_and_model_parallel_group() if self.config.megatron.ep > 1 else None
        return MegatronCausalLM(gpt, self.spec.vocab_size, experts)

    def replay_routes(self):
        """megatron-core's routers, replaying the rollout's experts through their `router_replay` hook."""
        from services.common.moe_routing import register
        from services.trainer.megatron.routing import MegatronRoutes

        try:
            routes = MegatronRoutes(self.model.gpt)
        except ValueError as exc:
            raise FieldError("routing_replay", str(exc)) from None
        self.model.routes = routes
        register(self.model, routes)
        return routes

    def clip_grads(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.grads.clip(params, max_norm)

    def refresh_weights(self) -> None:
        """After a step: rank 0's copy is what the weight sync sends, unless every rank sends its own shards."""
        if self.gather_every_step:
            self.gather_weights()

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Collective: every rank's shards to rank 0, copied into its transformers model's tensors (the same
        objects for the whole run: a weight-sync sender holds them)."""
        from services.trainer.megatron.convert import gather_to_hf, to_hf_module

        canonical = gather_to_hf(self.model.gpt.state_dict(), self.spec, self.side)
        if self.hf is None:
            return
        assert canonical is not None
        params = dict(self.hf.named_parameters())
        for name, tensor in to_hf_module(canonical, self.hf.state_dict()).items():
            if name in params:
                params[name].copy_(tensor)

    def local_shards(self) -> tuple[dict[str, torch.Tensor], list]:
        """This rank's live parameters (updated in place by every step) and their layout for the weight exchange:
        the coordinates megatron-core's parallel_state gave this rank, and the layout those coordinates imply,
        checked against the names and shapes the model holds (a mismatch stops start-up, naming the tensors)."""
        from services.trainer.megatron.convert import VOCAB_TENSORS
        from services.weight_exchange.client.layouts.megatron import megatron_shards

        params = {name: p.detach() for name, p in self.model.gpt.named_parameters()}
        shards = megatron_shards(self.spec, self.parallel(), "float32")  # the parameters train in float32
        declared = {s.local_name: s.local_shape for s in shards}
        # a vocab shard holding only padding rows has nothing to send: the layout leaves it out
        actual = {name: tuple(t.shape) for name, t in params.items() if name in declared or name not in VOCAB_TENSORS}
        if declared != actual:
            wrong = sorted(set(declared.items()) ^ set(actual.items()))[:4]
            raise RuntimeError(f"trainer rank {self.rank}: the megatron layout and the model disagree on {wrong}")
        return {name: params[name] for name in declared}, shards

    def sender_layout(self) -> tuple[str, dict[str, int]]:
        return "megatron", self.parallel().as_dict()

    def trainable_parameters(self) -> int:
        """The whole model's (rank 0 holds it gathered); a rank's own shards elsewhere."""
        model = self.hf if self.hf is not None else self.model
        return sum(p.numel() for p in model.parameters() if p.requires_grad)

    def weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: full tensors under the Hugging Face names; other ranks hold none."""
        return dict(self.hf.named_parameters()) if self.hf is not None else {}

    def save(self, path: str | pathlib.Path, *, version: int, state: dict[str, Any] | None = None,
             lineage: dict[str, Any] | None = None) -> pathlib.Path:
        """The gathered weights as Hugging Face files; resumable (``state``): with the ranks' distributed
        checkpoint, which ``state()`` wrote into a staging directory, moved in."""
        from services.trainer.megatron.dist_checkpoint import DIST

        assert self.hf is not None, "checkpoints are written by rank 0"
        directories = {}
        if state is not None:
            optimizer = dict(state["engine"]["optimizer"])
            directories[DIST] = pathlib.Path(optimizer.pop("staging"))
            state = {**state, "engine": {**state["engine"], "optimizer": optimizer}}
        return save_checkpoint(self.hf, self.tokenizer, path, version=version,
                               state_dict=host_copy(dict(self.hf.state_dict())), state=state, lineage=lineage,
                               directories=directories)

    def optimizer_state(self) -> dict[str, Any]:
        """Collective: every rank writes its model and optimizer shards (megatron-core's distributed checkpoint)
        into one staging directory under run_dir/checkpoints, which ``save`` moves into the checkpoint; rank 0
        returns where, with every rank's optimizer step counts."""
        from services.trainer.megatron import dist_checkpoint

        staging: list[Any] = [None]
        if self.rank == 0:
            root = pathlib.Path(self.config.run_dir) / "checkpoints"
            staging = [str(root / f".{dist_checkpoint.DIST}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")]
            pathlib.Path(staging[0]).mkdir(parents=True)
        dist.broadcast_object_list(staging, src=0)
        steps = dist_checkpoint.save(self.model.gpt, self.optimizer, staging[0])
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, steps)
        merged = {key: value for rank_steps in every for key, value in rank_steps.items()}
        return {"layout": str(self.side), "staging": staging[0], "steps": merged} if self.rank == 0 else {}

    def restore(self, path: str | pathlib.Path) -> dict[str, Any]:
        """Collective: every rank loads its own shards of the model and of the optimizer's state from the
        checkpoint's distributed checkpoint, whatever tp / pp / ep / dp layout wrote it (rank 0 reads the rest of
        the state and shares the schedule, RNG and step counts)."""
        from services.trainer.megatron import dist_checkpoint

        state: dict[str, Any] = {}
        shared: list[Any] = [None]
        if self.rank == 0:
            state = read_state(path)
            check_written_for(state["engine"], self.config, path)
            engine = state["engine"]
            if "steps" not in engine["optimizer"] or not (pathlib.Path(path) / dist_checkpoint.DIST).is_dir():
                raise ValueError(f"checkpoint {path} holds no megatron-core distributed checkpoint "
                                 f"({dist_checkpoint.DIST}/): written by an older meshrl, resume it there")
            shared = [{"steps": engine["optimizer"]["steps"], "schedule": engine["schedule"], "rng": engine["rng"]}]
        dist.broadcast_object_list(shared, src=0)
        got = shared[0]
        dist_checkpoint.load(self.model.gpt, self.optimizer, str(pathlib.Path(path) / dist_checkpoint.DIST),
                             got["steps"])
        self.load_schedule_and_rng(got)
        self.gather_weights()
        return state

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _architecture(config) -> dict[str, Any]:
    """What the GPTModel needs beyond the layout's ModelSpec, from the transformers config."""
    rope = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    out = {"rope_theta": float(rope or 10000.0), "norm_eps": float(getattr(config, "rms_norm_eps", 1e-6)),
           "max_sequence_length": int(getattr(config, "max_position_embeddings", 4096))}
    if getattr(config, "num_experts", 0):
        # Qwen3-MoE routes by softmax over all experts then top-k, renormalised when norm_topk_prob: megatron-core's
        # top-k then softmax is the same; without renormalisation it is its pre-softmax router
        out.update(moe_topk=int(config.num_experts_per_tok),
                   moe_router_pre_softmax=not getattr(config, "norm_topk_prob", True))
    return out
