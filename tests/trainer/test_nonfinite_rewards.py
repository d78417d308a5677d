"""A non-finite reward (an agent's value past float32 arrives as inf) leaves out its own group, not the step."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.common.contracts import data_pb2
from services.trainer.algorithms import AlgorithmConfig
from services.trainer.batching import pack
from services.trainer.step import OptimConfig, policy_logp, train_step
from tests.trainer.test_batching import traj


def batch_with_one_inf_reward() -> list[data_pb2.Trajectory]:
    trajs = [traj(f"{g}-{i}", g, [1, 2], [3 + i % 2, 5], 1.0 if i % 2 == 0 else 0.0)
             for g in ("g0", "g1", "g2") for i in range(4)]
    trajs[5].reward = 1e39  # a float field: stored as inf
    assert math.isinf(trajs[5].reward)
    return trajs


def test_pack_leaves_out_the_group_with_an_inf_reward_and_keeps_the_others():
    batch = pack(batch_with_one_inf_reward(), 0)
    assert batch.size == 8 and bool(torch.isfinite(batch.rewards).all())
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4  # g0 and g2


def test_pack_refuses_a_batch_whose_every_group_has_a_non_finite_reward():
    bad = traj("a", "g", [1], [2], float("nan"))
    step = traj("b", "h", [1], [2], 1.0)
    step.step_rewards.add(end=1, reward=float("inf"))
    with pytest.raises(ValueError, match=r"^reward: not finite in a; every group of the batch has a non-finite reward \(g, h\)"):
        pack([bad, step], 0)


@pytest.mark.parametrize("reward_clip", [None, 20.0])
def test_the_other_groups_still_train_when_one_reward_is_inf(reward_clip):
    """Without a reward clip the inf makes its group's advantages NaN (every minibatch would skip); with one, the
    bogus row would train as the clip value: either way it must not reach the step."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    batch = pack(batch_with_one_inf_reward(), 0)
    with torch.no_grad():
        batch.behav_logp = policy_logp(model, batch, 1.0) * batch.loss_mask
    algo = AlgorithmConfig.from_preset("grpo", reward_clip=reward_clip).build()
    optim = OptimConfig(lr=1e-2, minibatches=4)
    optimizer, schedule = optim.build(model)
    metrics = train_step(model, optimizer, algo, batch, version=0, optim=optim, temperature=1.0,
                         generator=torch.Generator().manual_seed(0), schedule=schedule)
    assert metrics["nonfinite_skipped"] == 0 and metrics["updates"] == 4
    assert metrics["samples"] == 8 and metrics["reward_mean"] == 0.5
