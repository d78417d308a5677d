"""Process rewards: packed onto the token that ends each step, checked at every edge, and turned into per-step
advantages by `reward_level: process` (DeepSeekMath's process supervision)."""

from __future__ import annotations

import pytest
import torch

from services.common.bus import InvalidMessage
from services.common.contracts import data_pb2
from services.reward.scoring import validate_trajectory
from services.trainer.algorithms import AlgorithmConfig
from services.trainer.batching import pack


def traj(tid: str, group: str, completion: int, reward: float, steps=(), mask=None) -> data_pb2.Trajectory:
    return data_pb2.Trajectory(
        trajectory_id=tid, group_id=group, prompt_ids=[1, 2], completion_ids=[3] * completion,
        behavior_logprobs=[0.0] * completion, versions=[0] * completion,
        loss_mask=mask if mask is not None else [1] * completion, reward=reward,
        step_rewards=[data_pb2.StepReward(end=e, reward=r) for e, r in steps])


def test_pack_puts_each_step_reward_on_the_cell_that_predicts_its_last_token():
    batch = pack([traj("a", "g", 4, 1.0, [(1, 0.5), (4, 2.0)]), traj("b", "g", 2, 0.0)], pad_token_id=0)
    # completion token j of a row with a 2-token prompt is predicted at column 1 + j
    assert batch.step_mask[0].nonzero().flatten().tolist() == [1, 4]
    assert batch.step_rewards[0, [1, 4]].tolist() == [0.5, 2.0] and batch.step_rewards[0].sum() == 2.5
    assert not batch.step_mask[1].any()
    assert bool((batch.loss_mask.bool() | ~batch.step_mask).all())


@pytest.mark.parametrize("steps, mask, field", [
    ([(2, 1.0), (2, 1.0)], None, "step_rewards[1].end"),       # not increasing
    ([(0, 1.0)], None, "step_rewards[0].end"),                 # before the first token
    ([(5, 1.0)], None, "step_rewards[0].end"),                 # past the completion
    ([(1, float("nan"))], None, "step_rewards[0].reward"),
    ([(2, 1.0)], [1, 0, 1, 1], "not trained"),                 # ends on a tool-output token
])
def test_bad_step_rewards_are_refused_at_every_edge_naming_the_field(steps, mask, field):
    bad = traj("x", "g", 4, 1.0, steps, mask)
    with pytest.raises(InvalidMessage, match=field.replace("[", r"\[").replace("]", r"\]")):
        validate_trajectory(bad)
    with pytest.raises(ValueError, match=r"step_rewards\[\d\]"):
        pack([bad], pad_token_id=0)


def _advantages(preset: str, batch, **overrides) -> torch.Tensor:
    algo = AlgorithmConfig.from_preset(preset, **overrides).build()
    return algo.compute_advantages(batch.rewards, batch.group_ids, batch.loss_mask, lengths=batch.lengths,
                                   truncated=batch.truncated, step_rewards=batch.step_rewards,
                                   step_mask=batch.step_mask).advantages


def test_process_advantage_is_the_sum_of_normalised_step_rewards_from_each_token_on():
    # one group, three steps in all: rewards 1, 0 (row a) and 2 (row b)
    batch = pack([traj("a", "g", 4, 0.0, [(2, 1.0), (4, 0.0)]), traj("b", "g", 3, 0.0, [(3, 2.0)])], pad_token_id=0)
    values = torch.tensor([1.0, 0.0, 2.0], dtype=torch.double)
    norm = ((values - values.mean()) / (values.std() + 1e-5)).float()
    adv = _advantages("grpo_process", batch)
    a = adv[0][batch.loss_mask[0].bool()]
    b = adv[1][batch.loss_mask[1].bool()]
    torch.testing.assert_close(a, torch.stack([norm[0] + norm[1]] * 2 + [norm[1]] * 2))
    torch.testing.assert_close(b, norm[2].repeat(3))
    # outcome level ignores the steps: equal outcome rewards, no signal
    assert _advantages("grpo", batch).abs().max() == 0


def test_rows_without_steps_train_as_their_outcome_reward():
    batch = pack([traj("a", "g", 3, 1.0), traj("b", "g", 2, 0.0), traj("c", "h", 2, 3.0), traj("d", "h", 4, 1.0)],
                 pad_token_id=0)
    torch.testing.assert_close(_advantages("grpo_process", batch), _advantages("grpo", batch))


def test_shaping_applies_per_step_with_the_overlong_penalty_on_the_last_step():
    batch = pack([traj("a", "g", 4, 0.0, [(1, 1.0), (4, 1.0)])], pad_token_id=0)
    algo = AlgorithmConfig.from_preset("grpo_process", overlong_penalty=True, max_new_tokens=4, overlong_tokens=2,
                                       reward_norm_mean=None, reward_norm_std=None, reward_scaling=2.0).build()
    tok, shaped = algo.process_token_rewards(batch.rewards, batch.group_ids, batch.loss_mask, batch.step_rewards,
                                             batch.step_mask, lengths=batch.lengths)
    # length 4 of at most 4 with a 2-token cache: penalty -1 on the last step only, then scaled by 2
    assert tok[0, batch.step_mask[0]].tolist() == [2.0, 0.0] and shaped.tolist() == [2.0]


def test_sequence_level_objectives_refuse_process_rewards():
    for preset in ("gspo", "dpo", "sft"):
        with pytest.raises(ValueError, match="reward_level"):
            AlgorithmConfig.from_preset(preset, reward_level="process")
    with pytest.raises(ValueError, match="reward_level"):
        AlgorithmConfig.from_preset("grpo", reward_level="token")
