"""Sample selection of the offline presets, and the trainer config's algorithm checks."""

from __future__ import annotations

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.batching import batch_staleness
from services.trainer.config import TrainerConfig
from services.trainer.optim import StatsMean
from services.trainer.selection import dpo_pairs, sft_rows


def test_dpo_pairs_take_highest_over_lowest_per_group_and_skip_ties():
    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.9, 0.2, 0.9])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 2])
    chosen, rejected = dpo_pairs(rewards, groups)
    assert chosen.tolist() == [1, 7] and rejected.tolist() == [0, 6]  # group 1 ties; first of equals wins
    assert (rewards[chosen] > rewards[rejected]).all()


def test_dpo_pairs_on_non_contiguous_groups_and_no_pairs():
    chosen, rejected = dpo_pairs(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([5, 9, 5, 9]))
    assert chosen.tolist() == [0, 3] and rejected.tolist() == [2, 1]
    chosen, rejected = dpo_pairs(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]))
    assert chosen.numel() == rejected.numel() == 0


def test_sft_keeps_rewarded_samples_only():
    rewards = torch.tensor([0.0, 1.0, 0.3, -1.0, 1.0])
    assert sft_rows(rewards, 0.0).tolist() == [1, 2, 4]
    assert sft_rows(rewards, 0.5).tolist() == [1, 4]
    assert sft_rows(torch.zeros(3), 0.0).numel() == 0


def test_batch_staleness_histogram_counts_rows_by_their_oldest_token():
    versions = torch.tensor([[-1, 3, 3, -1], [-1, 2, 3, 3], [-1, -1, 1, -1], [-1, 3, -1, -1]])
    out = batch_staleness(versions, 3)
    assert out["staleness_hist_0"] == 2 and out["staleness_hist_1"] == 1 and out["staleness_hist_2"] == 1
    assert out["staleness_traj_max"] == 2 and out["staleness_traj_mean"] == pytest.approx(0.75)


def test_stats_reduce_means_and_maxima():
    acc = StatsMean()
    acc.add({"loss": 1.0, "importance_weight_max": 2.0})
    acc.add({"loss": 3.0, "importance_weight_max": 1.5})
    assert acc.result() == {"loss": 2.0, "importance_weight_max": 2.0, "updates": 2.0}


def test_trainer_config_builds_every_preset_and_passes_max_new_tokens():
    cfg = TrainerConfig(algo="dapo", max_new_tokens=16)
    assert cfg.algorithm_config().max_new_tokens == 16
    assert TrainerConfig(algo="dapo", algo_overrides={"max_new_tokens": 4}).algorithm_config().max_new_tokens == 4
    # the run configs' online override is ignored by the offline presets, so `--algo dpo` just works
    for name in ("dpo", "sft"):
        algo = TrainerConfig(algo=name, algo_overrides={"dynamic_sampling": True}).build_algorithm()
        assert algo.is_offline and not algo.config.dynamic_sampling


@pytest.mark.parametrize(("env", "field"), [
    ({"MESHRL_TRAINER__ALGO": "ppo2"}, "algo: unknown preset 'ppo2'"),
    ({"MESHRL_TRAINER__ALGO_OVERRIDES": "{eps_clipp: 0.1}"}, "algo_overrides: unknown algorithm setting"),
    ({"MESHRL_TRAINER__ALGO_OVERRIDES": "{eps_clip: -1}"}, "algo_overrides: algorithm setting eps_clip"),
    ({"MESHRL_TRAINER__MAX_NEW_TOKENS": "0"}, "max_new_tokens"),
    ({"MESHRL_TRAINER__LORA__R": "0"}, "lora.r"),
    ({"MESHRL_TRAINER__CRITIC__OPTIM__LR": "0"}, "optim.lr"),
    ({"MESHRL_TRAINER__LORA__RANK": "4"}, "trainer.lora.rank: unknown key"),
])
def test_bad_trainer_settings_stop_start_up_naming_the_field(env, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        load_config(TrainerConfig, "trainer", env=env)


def test_nested_trainer_config_from_env():
    cfg = load_config(TrainerConfig, "trainer", env={
        "MESHRL_TRAINER__ALGO": "ppo", "MESHRL_TRAINER__LORA__ENABLED": "true",
        "MESHRL_TRAINER__LORA__TARGET_MODULES": "q_proj,v_proj", "MESHRL_TRAINER__CRITIC__OPTIM__LR": "0.001",
        "MESHRL_TRAINER__REFERENCE__ALWAYS": "true"})
    assert cfg.lora.enabled and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.critic.optim.lr == 0.001 and cfg.reference.always and cfg.build_algorithm().needs_critic
