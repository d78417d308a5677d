"""Named algorithm presets: the settings each one changes from the ``AlgorithmConfig`` defaults.

Every entry lists its key settings explicitly (even where they equal the defaults) so that
``python -m services.trainer.algorithms --list`` shows what defines the algorithm.
"""

from __future__ import annotations

from typing import Any

_GROUP = {"reward_norm_mean": "group", "reward_norm_std": "group"}
_DECOUPLED = {"use_decoupled_loss": True, "behav_imp_weight_cap": 5.0}

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"objective": "ppo", **_GROUP, "eps_clip": 0.2, **_DECOUPLED, "loss_agg": "token_mean"},
    "grpo_process": {"objective": "ppo", **_GROUP, "reward_level": "process", "eps_clip": 0.2, **_DECOUPLED,
                     "loss_agg": "token_mean"},
    "ppo": {
        "objective": "ppo",
        "use_critic": True,
        "reward_norm_mean": None,
        "reward_norm_std": None,
        "adv_norm": True,
        "discount": 1.0,
        "gae_lambda": 1.0,
        "value_eps_clip": 0.5,
        "eps_clip": 0.2,
        **_DECOUPLED,
    },
    "drgrpo": {
        "objective": "ppo",
        "reward_norm_mean": "group",
        "reward_norm_std": None,
        "eps_clip": 0.2,
        **_DECOUPLED,
        "loss_agg": "seq_mean_token_sum_norm",
    },
    "dapo": {
        "objective": "ppo",
        **_GROUP,
        "eps_clip": 0.2,
        "eps_clip_higher": 0.28,
        **_DECOUPLED,
        "overlong_penalty": True,
        "overlong_penalty_factor": 1.0,
        "dynamic_sampling": True,
        "loss_agg": "token_mean",
    },
    "liteppo": {
        "objective": "ppo",
        "reward_norm_mean": "group",
        "reward_norm_std": "batch",
        "eps_clip": 0.2,
        **_DECOUPLED,
    },
    "rloo": {
        "objective": "ppo",
        "reward_norm_mean": "group",
        "reward_norm_std": None,
        "reward_norm_leave_one_out": True,
        "eps_clip": 0.2,
        **_DECOUPLED,
    },
    "reinforce_pp": {
        "objective": "ppo",
        "reward_norm_mean": None,
        "reward_norm_std": None,
        "kl_ctl": 0.001,
        "kl_estimator": "k1",
        "adv_norm": True,
        "eps_clip": 0.2,
        **_DECOUPLED,
    },
    "gspo": {
        "objective": "gspo",
        **_GROUP,
        "eps_clip": 3e-4,
        "eps_clip_higher": 4e-4,
        **_DECOUPLED,
        "loss_agg": "seq_mean_token_mean",
    },
    "sapo": {"objective": "sapo", **_GROUP, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "use_decoupled_loss": False},
    "cispo": {"objective": "cispo", **_GROUP, "eps_clip": 1.0, "eps_clip_higher": 0.28, **_DECOUPLED},
    "m2po": {"objective": "ppo", **_GROUP, "eps_clip": None, **_DECOUPLED, "m2_threshold": 0.04},
    "icepop": {
        "objective": "ppo",
        **_GROUP,
        "eps_clip": 0.2,
        "use_decoupled_loss": True,
        "behav_imp_weight_floor": 0.5,
        "behav_imp_weight_cap": 5.0,
        "behav_imp_weight_mode": "mask",
        "behav_imp_weight_level": "token",
    },
    "kpop": {
        "objective": "ppo",
        **_GROUP,
        "eps_clip": 0.2,
        "use_decoupled_loss": True,
        "behav_imp_weight_metric": "binary_kl",
        "behav_binary_kl_cap": 0.1,
        "behav_imp_weight_cap": None,
        "behav_imp_weight_mode": "mask",
        "behav_imp_weight_level": "token",
    },
    "distill": {
        "objective": "ppo",
        **_GROUP,
        "reward_scaling": 0.0,   # the verifier's reward off; > 0 mixes its group-normalised advantage in
        "distill_coef": 1.0,
        "eps_clip": 0.2,
        **_DECOUPLED,
        "loss_agg": "token_mean",
    },
    "gkd": {
        "objective": "ppo",
        **_GROUP,
        "reward_scaling": 0.0,
        "distill_topk": 20,
        "eps_clip": 0.2,
        **_DECOUPLED,
        "loss_agg": "token_mean",
    },
    "dpo": {"objective": "dpo", "dpo_beta": 0.1, "dpo_loss_type": "sigmoid"},
    "sft": {"objective": "sft", "loss_agg": "token_mean"},
}

DESCRIPTIONS: dict[str, str] = {
    "grpo": "GRPO: group mean/std advantages, decoupled PPO clip (meshrl default)",
    "grpo_process": "GRPO with process supervision: step rewards normalised over the group's steps",
    "ppo": "PPO with a critic: GAE advantages, batch-whitened, clipped value loss",
    "drgrpo": "Dr.GRPO: group mean only, token sums over a constant normaliser",
    "dapo": "DAPO: clip-higher, overlong penalty, dynamic sampling, token-mean",
    "liteppo": "LitePPO: group mean, batch std, token-mean",
    "rloo": "RLOO: leave-one-out group baseline",
    "reinforce_pp": "REINFORCE++: KL in the reward, batch-normalised returns",
    "gspo": "GSPO: sequence-level ratio and clip, sequence-mean loss",
    "sapo": "SAPO: soft sigmoid gate instead of a hard clip",
    "cispo": "CISPO: clipped stop-gradient importance weight on log pi",
    "m2po": "M2PO: second-moment token masking, no ratio clip",
    "icepop": "IcePop: tokens whose train/infer ratio leaves [0.5, 5] are masked (two-sided), PPO clip",
    "kpop": "KPop: tokens whose binary KL between train and infer probability exceeds 0.1 are masked, PPO clip",
    "distill": "on-policy distillation: each sampled token's advantage is log pi_teacher - log pi_student",
    "gkd": "on-policy distillation on the teacher's top-k: forward KL from its 20 likeliest tokens at every position "
           "of the student's samples (GKD, beta 0)",
    "dpo": "DPO: offline preference pairs against a frozen reference",
    "sft": "SFT: negative log-likelihood of the trained tokens",
}

ONLINE_PRESETS = tuple(name for name, p in PRESETS.items() if p["objective"] not in ("dpo", "sft"))


def dynamic_sampling(preset: str, overrides: dict[str, Any]) -> bool:
    """Whether the trainer's algorithm wants dynamic sampling (the builder then refills); offline ones never do."""
    settings = {**PRESETS.get(preset, {}), **overrides}
    return settings.get("objective") not in ("dpo", "sft") and bool(settings.get("dynamic_sampling", False))
