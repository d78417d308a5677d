"""RL objectives for the meshrl trainer: pure tensor functions plus a preset-driven ``Algorithm``.

    cfg = AlgorithmConfig.from_preset("grpo", eps_clip=0.2)   # unknown preset / key -> ValueError
    algo = cfg.build()
    adv = algo.advantages(rewards, group_ids, loss_mask)     # float[B, T]
    keep = algo.filter_groups(rewards, group_ids)            # bool[B]
    loss, stats = algo.policy_loss(logp=..., prox_logp=..., behav_logp=..., advantages=adv,
                                   loss_mask=..., versions=..., current_version=v)

Default objective (decoupled PPO, areal.md §1.6), per trained token:
    u = exp(logp - prox_logp)              clipped to [1 - eps_clip, 1 + eps_clip_higher]
    w = exp(prox_logp - behav_logp)        no grad; tokens with w > behav_imp_weight_cap are
                                           *masked* (dropped), as AReaL does by default: a clamped
                                           weight would still push on tokens sampled by a policy
                                           far from pi_prox, in a direction we cannot correct
    loss = token_mean(-w * min(u * A, clip(u) * A))   masked tokens still count in the denominator
``behav_imp_weight_mode="clamp"`` switches to truncated importance sampling instead.
"""

from .advantages import (
    drgrpo_advantages,
    gae,
    grpo_advantages,
    liteppo_advantages,
    normalize_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)
from .aggregation import aggregate, loss_weight, masked_mean, masked_sum
from .algorithm import AdvantageResult, Algorithm
from .config import AlgorithmConfig
from .losses import (
    TokenLoss,
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    ppo_clip_loss,
    sapo_loss,
    token_entropy,
    token_logp,
    value_loss,
)
from .offline import dpo_loss, sequence_logp, sft_loss
from .offpolicy import behaviour_weights, loglinear_prox_logp, m2po_mask, staleness, staleness_histogram
from .presets import DESCRIPTIONS, ONLINE_PRESETS, PRESETS
from .sampling import GroupFilter, filter_uniform_groups
from .shaping import kl_estimate, kl_reward_penalty, overlong_penalty, shape_rewards

__all__ = [
    "DESCRIPTIONS",
    "ONLINE_PRESETS",
    "PRESETS",
    "AdvantageResult",
    "Algorithm",
    "AlgorithmConfig",
    "GroupFilter",
    "TokenLoss",
    "aggregate",
    "behaviour_weights",
    "cispo_loss",
    "decoupled_ppo_loss",
    "dpo_loss",
    "drgrpo_advantages",
    "filter_uniform_groups",
    "gae",
    "grpo_advantages",
    "gspo_loss",
    "kl_estimate",
    "kl_reward_penalty",
    "liteppo_advantages",
    "loglinear_prox_logp",
    "loss_weight",
    "m2po_mask",
    "masked_mean",
    "masked_sum",
    "normalize_rewards",
    "overlong_penalty",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sapo_loss",
    "sequence_logp",
    "sft_loss",
    "shape_rewards",
    "staleness",
    "staleness_histogram",
    "token_entropy",
    "token_logp",
    "token_rewards",
    "value_loss",
    "whiten",
]
