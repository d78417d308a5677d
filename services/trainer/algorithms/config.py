"""``AlgorithmConfig``: every algorithm setting in one typed config; ``build()`` returns an ``Algorithm``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .aggregation import AGG_MODES
from .algorithm import Algorithm
from .presets import PRESETS
from .shaping import KL_ESTIMATORS

OBJECTIVES = ("ppo", "gspo", "sapo", "cispo", "dpo", "sft")
_CHOICES: dict[str, tuple[Any, ...]] = {
    "objective": OBJECTIVES,
    "reward_norm_mean": ("group", "batch", None),
    "reward_norm_std": ("group", "batch", None),
    "kl_estimator": KL_ESTIMATORS,
    "kl_loss_estimator": KL_ESTIMATORS,
    "value_loss_type": ("mse", "huber"),
    "prox_logp_method": ("recompute", "loglinear"),
    "behav_imp_weight_mode": ("mask", "clamp"),
    "behav_imp_weight_level": ("token", "sequence"),
    "behav_imp_weight_metric": ("ratio", "binary_kl"),
    "loss_agg": AGG_MODES,
    "dpo_loss_type": ("sigmoid", "ipo"),
    "reward_level": ("outcome", "process"),
}


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    preset: str | None = None  # the preset this config came from (informational)
    objective: str = "ppo"  # ppo | gspo | sapo | cispo | dpo | sft

    # Reward shaping (sequence rewards, before advantages)
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float | None = 20.0
    mask_truncated_reward: bool = False  # reward 0 for outputs cut at max_new_tokens (needs `truncated`)
    overlong_penalty: bool = False  # DAPO soft overlong punishment
    overlong_tokens: int | None = None  # L_cache; None = max(1, max_new_tokens // 5) (DAPO: 4096 of 20480)
    overlong_penalty_factor: float = 1.0
    max_new_tokens: int | None = None  # the rollout's generation limit (overlong penalty, Dr.GRPO constant)

    # KL to a frozen reference policy
    kl_ctl: float = 0.0  # per-token reward penalty -kl_ctl * KL_est(old, ref)
    kl_estimator: str = "k1"
    kl_loss_coef: float = 0.0  # KL(pi_theta || ref) added to the loss instead (GRPO paper)
    kl_loss_estimator: str = "k3"
    # on-policy distillation: each token's advantage gains distill_coef * (log pi_teacher - log pi_student) of its
    # own sampled token (reverse KL, per token, not summed forward); the teacher is the reference model
    # (trainer.reference.model_path), which must share the policy's tokenizer
    distill_coef: float = 0.0
    # bounds each token's log pi_teacher - log pi_student to [-distill_clip, distill_clip] (None: unbounded). A peaked
    # teacher gives a student's rare wrong token -15 to -25 nats against +0.1 to +1 for a right one: those few tokens
    # then own the whole (norm-clipped) gradient and push the answer positions toward an average token
    distill_clip: float | None = None
    # k > 0: also the forward KL from the teacher to the student over the teacher's k likeliest tokens and one bucket
    # for the rest, at every trained position of the student's own samples (GKD's on-policy supervised term, beta 0),
    # weighted by distill_topk_coef. Sampled reverse KL only tells the student that a sampled token is bad; this
    # names the teacher's choice at each position. The teacher loaded here or served (asked for logprobs k)
    distill_topk: int = 0
    distill_topk_coef: float = 1.0

    # Advantages
    reward_level: str = "outcome"  # outcome (one reward per sequence) | process (per-step rewards, see algorithm.py)
    reward_norm_mean: str | None = "group"  # group | batch | None
    reward_norm_std: str | None = "group"  # group | batch | None
    reward_norm_leave_one_out: bool = False  # RLOO baseline
    std_unbiased: bool = True
    norm_eps: float = 1e-5
    adv_norm: bool = False  # whiten token advantages over the batch (mean and std)
    discount: float = 1.0
    gae_lambda: float = 1.0
    use_critic: bool = False
    value_eps_clip: float | None = 0.5
    value_loss_type: str = "mse"

    # Policy objective
    eps_clip: float | None = 0.2  # None = no ratio clip
    eps_clip_higher: float | None = None  # None = eps_clip (DAPO clip-higher otherwise)
    c_clip: float | None = None  # dual clip, > 1 (ppo: per token, gspo: per sequence; others reject it)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    entropy_coef: float = 0.0

    # Asynchronous off-policy corrections
    use_decoupled_loss: bool = True
    prox_logp_method: str = "recompute"  # recompute | loglinear
    behav_imp_weight_cap: float | None = 5.0  # upper bound of pi_prox / pi_behav
    behav_imp_weight_floor: float | None = None  # lower bound (two-sided IcePop band)
    behav_imp_weight_mode: str = "mask"  # mask (drop the token) | clamp (truncated IS)
    behav_imp_weight_level: str = "token"  # token | sequence (geometric mean)
    # what decides a masked token: ratio (the band above) | binary_kl (KPop: KL of Bernoulli(pi_prox(y)) from
    # Bernoulli(pi_behav(y)) above behav_binary_kl_cap; the ratio band then unset)
    behav_imp_weight_metric: str = "ratio"
    behav_binary_kl_cap: float | None = None
    m2_threshold: float | None = None  # M2PO second-moment masking

    # Aggregation, dynamic sampling, offline
    loss_agg: str = "token_mean"
    loss_agg_constant: int | None = None  # Dr.GRPO normaliser; None = max_new_tokens, else padded T
    dynamic_sampling: bool = False
    dpo_beta: float = 0.1
    dpo_loss_type: str = "sigmoid"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"algorithm setting {name}={getattr(self, name)!r}: expected one of {choices}")
        _positive = (
            "reward_clip",
            "overlong_tokens",
            "max_new_tokens",
            "value_eps_clip",
            "m2_threshold",
            "loss_agg_constant",
            "behav_imp_weight_cap",
            "behav_binary_kl_cap",
            "sapo_tau_pos",
            "sapo_tau_neg",
            "dpo_beta",
            "norm_eps",
            "distill_clip",
            "distill_topk_coef",
        )
        for name in _positive:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"algorithm setting {name}={value!r} must be > 0")
        for name in ("eps_clip", "eps_clip_higher", "behav_imp_weight_floor", "kl_ctl", "kl_loss_coef", "entropy_coef",
                     "distill_coef"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"algorithm setting {name}={value!r} must be >= 0")
        if not 0 <= self.distill_topk <= 1024:
            raise ValueError(f"algorithm setting distill_topk={self.distill_topk!r} must be in [0, 1024] (0: off)")
        if self.c_clip is not None and not self.c_clip > 1:
            raise ValueError(f"algorithm setting c_clip={self.c_clip!r} must be > 1")
        if self.c_clip is not None and self.objective not in ("ppo", "gspo"):
            raise ValueError(
                f"algorithm setting c_clip={self.c_clip!r}: the dual clip bounds a clipped ratio surrogate (ppo, gspo); "
                f"objective {self.objective!r} has none (sapo gates softly, cispo clips a stop-gradient weight)"
            )
        for name in ("discount", "gae_lambda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algorithm setting {name}={getattr(self, name)!r} must be in [0, 1]")
        floor, cap = self.behav_imp_weight_floor, self.behav_imp_weight_cap
        if floor is not None and cap is not None and floor >= cap:
            raise ValueError(f"algorithm setting behav_imp_weight_floor={floor} must be < behav_imp_weight_cap={cap}")
        self._check_metric()
        if not self.use_decoupled_loss:
            for name, inert in (("prox_logp_method", "recompute"), ("m2_threshold", None)):
                if getattr(self, name) != inert:
                    raise ValueError(f"algorithm setting {name}={getattr(self, name)!r} needs use_decoupled_loss=True")
        if self.reward_level == "process" and self.objective in ("gspo", "dpo", "sft"):
            raise ValueError(
                f"algorithm setting reward_level='process': objective {self.objective!r} weighs whole sequences; "
                "process rewards need a token-level objective (ppo, sapo, cispo)"
            )
        if self.objective in ("dpo", "sft") and (self.use_critic or self.dynamic_sampling):
            raise ValueError(
                f"algorithm objective {self.objective!r} is offline: use_critic and dynamic_sampling must be off"
            )

    def _check_metric(self) -> None:
        if self.behav_imp_weight_metric == "ratio":
            if self.behav_binary_kl_cap is not None:
                raise ValueError(f"algorithm setting behav_binary_kl_cap={self.behav_binary_kl_cap!r} needs "
                                 "behav_imp_weight_metric='binary_kl'")
            return
        if self.behav_binary_kl_cap is None:
            raise ValueError("algorithm setting behav_binary_kl_cap must be set (> 0) with "
                             "behav_imp_weight_metric='binary_kl'")
        for name in ("behav_imp_weight_cap", "behav_imp_weight_floor"):
            if getattr(self, name) is not None:
                raise ValueError(f"algorithm setting {name}={getattr(self, name)!r} bounds the ratio; with "
                                 "behav_imp_weight_metric='binary_kl' the binary KL decides: set it to null")
        if self.behav_imp_weight_mode != "mask":
            raise ValueError(f"algorithm setting behav_imp_weight_mode={self.behav_imp_weight_mode!r}: "
                             "behav_imp_weight_metric='binary_kl' masks (there is no KL to clamp a weight to)")

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> AlgorithmConfig:
        """The preset's settings with ``overrides`` on top; unknown presets or keys raise ValueError."""
        if preset not in PRESETS:
            raise ValueError(f"unknown algorithm preset {preset!r}; known presets: {', '.join(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"preset"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown algorithm setting(s) {', '.join(map(repr, unknown))} for preset {preset!r}")
        return cls(preset=preset, **{**PRESETS[preset], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def build(self) -> Algorithm:
        if self.overlong_penalty:
            if self.max_new_tokens is None:
                raise ValueError("algorithm setting max_new_tokens is required when overlong_penalty is on")
            if self.overlong_tokens is not None and self.overlong_tokens > self.max_new_tokens:
                raise ValueError(
                    f"algorithm setting overlong_tokens={self.overlong_tokens} exceeds max_new_tokens={self.max_new_tokens}"
                )
        return Algorithm(self)
