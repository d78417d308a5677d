"""trainer.gradient_checkpointing: the decoder layers keep only their inputs for the backward, and the gradients
are the ones without it (padded and packed forwards, tiny Qwen3 and Llama); a model that cannot is refused at start,
naming the setting."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import FieldError
from services.trainer.backends.torch_backend import checkpoint_activations
from services.trainer.forward import logp_and_entropy
from services.trainer.packing import PackingConfig, packed_forwards
from tests.trainer.test_packing import MODELS, PACKED, batch


@pytest.mark.parametrize("packing", [PackingConfig(), PACKED], ids=["padded", "packed"])
@pytest.mark.parametrize("name", ["qwen3-sdpa", "llama-sdpa"])
def test_recomputed_activations_give_the_same_gradients(name, packing):
    b = batch(seed=3)

    def grads(checkpointed: bool) -> tuple[list[torch.Tensor], int]:
        model = MODELS[name]().train()
        if checkpointed:
            checkpoint_activations(model)
        kept = []  # bytes the forward keeps for the backward (inside a checkpointed layer: its inputs only)

        def keep(t: torch.Tensor) -> torch.Tensor:
            kept.append(t.numel() * t.element_size())
            return t

        with packed_forwards(packing), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp, entropy = logp_and_entropy(model, b, 1.0, entropy_grad=True)
        ((logp - 0.1 * entropy) * b.loss_mask).sum().backward()
        return [p.grad for p in model.parameters()], sum(kept)

    (plain, kept_plain), (recomputed, kept_recomputed) = grads(False), grads(True)
    assert kept_recomputed < 0.75 * kept_plain, (kept_recomputed, kept_plain)  # the logits stay kept
    for a, c in zip(plain, recomputed, strict=True):
        torch.testing.assert_close(c, a, atol=1e-6, rtol=1e-5)


def test_a_model_that_cannot_recompute_is_refused_naming_the_setting():
    with pytest.raises(FieldError, match="gradient_checkpointing"):
        checkpoint_activations(torch.nn.Linear(2, 2))
