"""Packing trajectories into next-token grids, and one training step with the decoupled loss."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.common.contracts import data_pb2
from services.trainer.algorithms import AlgorithmConfig
from services.trainer.batching import distinct_versions, pack, trajectory_staleness
from services.trainer.step import OptimConfig, policy_logp, train_step


def traj(tid, gid, prompt, completion, reward, versions=None, mask=None):
    n = len(completion)
    return data_pb2.Trajectory(trajectory_id=tid, group_id=gid, prompt_ids=prompt, completion_ids=completion,
                               behavior_logprobs=[-0.5 - 0.1 * i for i in range(n)], versions=versions or [0] * n,
                               loss_mask=mask or [1] * n, reward=reward)


def test_pack_aligns_completion_tokens_with_their_predicting_positions():
    batch = pack([traj("a", "g1", [5, 6, 7], [8, 9], 1.0, versions=[2, 3]),
                  traj("b", "g1", [5], [4, 3, 2], 0.0, mask=[1, 0, 1]),
                  traj("c", "g2", [1, 2], [3], 1.0)], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 0], [1, 2, 3, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0], [0, 1, 0, 0]]
    assert batch.versions.tolist() == [[-1, -1, 2, 3], [0, 0, 0, -1], [-1, 0, -1, -1]]
    assert batch.behav_logp[0, 2:].tolist() == pytest.approx([-0.5, -0.6])
    assert batch.group_ids.tolist() == [0, 0, 1] and batch.rewards.tolist() == [1.0, 0.0, 1.0]
    # a prediction at column t is of token t+1: the labels under the mask are exactly the completions
    labels = batch.input_ids[:, 1:]
    assert labels[batch.loss_mask.bool()].tolist() == [8, 9, 4, 2, 3]


def test_pack_rejects_misaligned_per_token_fields():
    bad = traj("x", "g", [1], [2, 3], 1.0)
    del bad.versions[:]
    with pytest.raises(ValueError, match="versions"):
        pack([bad], 0)


def test_staleness_and_versions_per_trajectory():
    t = traj("a", "g", [1], [2, 3, 4], 1.0, versions=[3, 3, 4])
    assert trajectory_staleness(t, 5) == 2 and distinct_versions(t) == 2


def test_train_step_raises_the_likelihood_of_rewarded_completions():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    trajs = [traj(f"t{i}", "g", [1, 2], [3 + i % 2, 5], 1.0 if i % 2 == 0 else 0.0) for i in range(8)]
    batch = pack(trajs, 0)
    with torch.no_grad():
        batch.behav_logp = policy_logp(model, batch, 1.0) * batch.loss_mask  # on-policy behaviour
    algo = AlgorithmConfig.from_preset("grpo").build()
    optim = OptimConfig(lr=1e-2, minibatches=2)
    optimizer, schedule = optim.build(model)
    before = policy_logp(model, batch, 1.0).detach()
    metrics = train_step(model, optimizer, algo, batch, version=0, optim=optim, temperature=1.0,
                         generator=torch.Generator().manual_seed(0), schedule=schedule)
    after = policy_logp(model, batch, 1.0).detach()
    assert metrics["updates"] == 2 and metrics["reward_mean"] == 0.5
    delta = (after - before)[:, 2]  # the first completion token: 3 (rewarded) or 4 (not)
    assert delta[0::2].mean() > 0 > delta[1::2].mean()


def test_linear_schedule_warms_up_then_decays():
    optim = OptimConfig(lr=1.0, warmup_updates=4, schedule="linear", min_lr_ratio=0.1, minibatches=2)
    factors = [optim.lr_factor(n, total_updates=20) for n in range(21)]
    assert factors[0] == pytest.approx(0.2) and factors[3] == pytest.approx(0.8) and factors[4] == pytest.approx(1.0)
    assert factors[20] == pytest.approx(0.1) and all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    with pytest.raises(ValueError, match="optim.schedule"):
        OptimConfig(schedule="cosine")
