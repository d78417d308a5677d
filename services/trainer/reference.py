"""The frozen reference policy for KL (reward penalty or loss term), DPO and distillation (the teacher): the
initial checkpoint or the one `model_path` names, never trained. With LoRA and no separate path it is the policy
with its adapters switched off, so it costs no second copy of the weights."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import torch

from services.common.errors import FieldError
from services.trainer.batching import PackedBatch
from services.trainer.forward import TeacherTopK, frozen_logp, frozen_logp_and_topk
from services.trainer.lora import is_lora
from services.trainer.served_reference import ServedReference


@dataclasses.dataclass(kw_only=True)
class ReferenceConfig:
    model_path: str = ""   # empty: the policy's initial checkpoint
    always: bool = False   # load one even when the algorithm needs none, to report the KL to it
    # served elsewhere instead of loaded here: the name of one of the run's frozen_models (the launcher fills url
    # and key_file), or url (an OpenAI-compatible base URL, with /v1) and key_file (its key) for another server
    served: str = ""
    url: str = ""
    key_file: str = ""
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if (self.url or self.served) and self.model_path:
            raise FieldError("reference.model_path", "set with url: the reference is either served or loaded here")
        if self.timeout_s <= 0:
            raise FieldError("reference.timeout_s", f"must be > 0, got {self.timeout_s}")

    def build(self, policy: torch.nn.Module, default_path: str) -> Reference | ServedReference:
        if self.served and not self.url:
            raise FieldError("reference.url", f"unset for the served reference {self.served!r}: the launcher sets it "
                             "from the run's frozen_models; outside the launcher set url and key_file")
        if self.url:
            key = pathlib.Path(self.key_file).read_text().strip() if self.key_file else ""
            return ServedReference(self.url, key, timeout_s=self.timeout_s)
        if is_lora(policy) and not self.model_path:
            return Reference(policy, adapters_off=True)
        from services.common.hf_models import load_lm

        model = load_lm(self.model_path or default_path, torch.float32)
        return Reference(model.eval().requires_grad_(False))


def check_teacher_tokenizer(policy_tokenizer, teacher_path: str) -> None:
    """Distillation compares the teacher's and the student's log-prob of each sampled token id: both must read ids
    as the same tokens. ValueError naming reference.model_path otherwise."""
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_path)
    mine, theirs = policy_tokenizer.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=str)[:3]
        raise FieldError("reference.model_path", f"the teacher's tokenizer ({len(theirs)} tokens) is not the "
                         f"policy's ({len(mine)}): e.g. {differ}; distillation needs one tokenizer")


class Reference:
    def __init__(self, model: torch.nn.Module, *, adapters_off: bool = False) -> None:
        self.model = model
        self.adapters_off = adapters_off

    def _weights(self):
        """The reference's weights for the duration: the policy's with its adapters off, or its own model's."""
        return self.model.disable_adapter() if self.adapters_off else contextlib.nullcontext()

    def logp(self, batch: PackedBatch, temperature: float) -> torch.Tensor:
        """Per-token log-probs under the reference, float[B, L-1], no grad."""
        with self._weights():
            return frozen_logp(self.model, batch, temperature)

    def logp_and_top(self, batch: PackedBatch, temperature: float, k: int) -> tuple[torch.Tensor, TeacherTopK]:
        """``logp`` and the k likeliest next tokens at every position (distill_topk), from one forward."""
        with self._weights():
            return frozen_logp_and_topk(self.model, batch, temperature, k)
