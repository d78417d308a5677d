"""``train_step``'s entropy bonus reaches the parameters: a step-level check, not a loss-level one."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.common.contracts import data_pb2
from services.trainer.algorithms import AlgorithmConfig, masked_mean, token_entropy
from services.trainer.batching import pack
from services.trainer.forward import frozen_logp, sequence_logits
from services.trainer.step import OptimConfig, train_step


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16))


def equal_reward_batch(model: torch.nn.Module):
    """Two groups of two whose rewards are equal within each group: every GRPO advantage is zero."""
    g = torch.Generator().manual_seed(0)
    trajs = [data_pb2.Trajectory(trajectory_id=f"t{i}", group_id=f"g{i // 2}",
                                 prompt_ids=torch.randint(0, 64, (3,), generator=g).tolist(),
                                 completion_ids=torch.randint(0, 64, (4,), generator=g).tolist(),
                                 behavior_logprobs=[0.0] * 4, versions=[0] * 4, loss_mask=[1] * 4,
                                 reward=float(i // 2), finish_reason="stop") for i in range(4)]
    batch = pack(trajs, 0)
    batch.behav_logp = frozen_logp(model, batch, 1.0) * batch.loss_mask
    return batch


def step_with(entropy_coef: float) -> tuple[torch.nn.Module, dict[str, float]]:
    model = tiny_model()
    batch = equal_reward_batch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    algo = AlgorithmConfig.from_preset("grpo", entropy_coef=entropy_coef).build()
    metrics = train_step(model, optimizer, algo, batch, version=0, optim=OptimConfig(lr=1e-2), temperature=1.0,
                         generator=torch.Generator().manual_seed(0))
    return model, metrics


def test_entropy_bonus_changes_the_update_when_advantages_are_zero():
    start = tiny_model()
    without, m0 = step_with(0.0)
    with_bonus, m1 = step_with(0.1)
    assert m0["advantage_abs_mean"] == m1["advantage_abs_mean"] == 0.0
    # no advantage, no bonus: the policy loss has no gradient, Adam moves nothing
    assert all(torch.equal(a, b) for a, b in zip(start.parameters(), without.parameters(), strict=True))
    moved = [not torch.equal(a, b) for a, b in zip(without.parameters(), with_bonus.parameters(), strict=True)]
    assert any(moved), "entropy_coef=0.1 left every parameter where entropy_coef=0 did"


def test_entropy_bonus_raises_the_entropy():
    trained, _ = step_with(0.5)
    start = tiny_model()
    batch = equal_reward_batch(start)

    def entropy(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(masked_mean(token_entropy(sequence_logits(model.eval(), batch)), batch.loss_mask.bool()))

    assert entropy(trained) > entropy(start)
