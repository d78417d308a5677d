"""What each preset is, in the terms the papers use: the rows of ``--list``. Pure, no I/O."""

from __future__ import annotations

from .config import AlgorithmConfig

COLUMNS = ("advantage", "loss aggregation", "clipping", "KL term", "off-policy correction")

# Where a preset departs from its paper by default (shown under the table).
NOTES: dict[str, str] = {
    "grpo": "KL term off by default; DeepSeekMath's GRPO uses beta = 0.04 with the k3 estimator in the loss "
    "(algo_overrides: {kl_loss_coef: 0.04, kl_loss_estimator: k3}, builds a reference model) and averages each "
    "sequence first (loss_agg: seq_mean_token_mean); the decoupled off-policy weight is meshrl's (async) addition",
    "dapo": "dynamic sampling refills in the builder: it over-issues prompts until each batch holds batch_size "
    "groups with reward variance (builder option dynamic_sampling, set by the launcher from this setting)",
    "icepop": "the ratio band is the paper's [alpha, beta] = [0.5, 5] on pi_train(theta_old) / pi_infer; "
    "tokens outside it are dropped, not clamped",
    "distill": "the teacher is trainer.reference.model_path, run in the trainer like a reference model, or served "
    "beside the stack (reference.served); it must share the policy's tokenizer; the verifier's reward is off "
    "(reward_scaling 0) unless mixed in",
    "kpop": "AReaL's rejection_sampling.metric=binary_kl; the threshold 0.1 is meshrl's default (a token with "
    "pi_behav 0.5 is masked once pi_prox leaves about [0.28, 0.72]); the kept tokens' weights are not capped",
}


def _bounds(low: float | None, high: float | None) -> str:
    return f"[{1 - low:g}, {1 + (low if high is None else high):g}]"


def advantage(c: AlgorithmConfig) -> str:
    if c.objective == "dpo":
        return "preference pairs (best vs worst of a group)"
    if c.objective == "sft":
        return "none (rejection-sampled NLL)"
    if c.use_critic:
        text = f"GAE (critic, gamma={c.discount:g}, lambda={c.gae_lambda:g})"
    elif c.reward_norm_leave_one_out:
        text = "reward - leave-one-out group mean"
    else:
        mean = {"group": "group mean", "batch": "batch mean", None: ""}[c.reward_norm_mean]
        std = {"group": "group std", "batch": "batch std", None: ""}[c.reward_norm_std]
        text = "reward" + (f" - {mean}" if mean else "") + (f", / {std}" if std else "")
    if c.reward_level == "process":
        text = f"per-step {text} (step rewards summed from each token on)"
    if c.distill_coef > 0:
        outcome = "" if c.reward_scaling == 0 else f" + {c.reward_scaling:g} x ({text})"
        ratio = "log pi_teacher - log pi_student"
        ratio = f"clip({ratio}, +-{c.distill_clip:g})" if c.distill_clip is not None else f"({ratio})"
        text = f"{c.distill_coef:g} x {ratio} per token{outcome}"
    elif c.reward_scaling == 0:
        text = "none (reward_scaling 0)"
    extras = [e for e, on in (("batch-whitened", c.adv_norm), ("overlong penalty", c.overlong_penalty),
                              ("dynamic sampling", c.dynamic_sampling)) if on]
    return text + "".join(f", {e}" for e in extras)


def clipping(c: AlgorithmConfig) -> str:
    if c.objective in ("dpo", "sft"):
        return "-"
    if c.objective == "sapo":
        return f"soft sigmoid gate (tau+ {c.sapo_tau_pos:g}, tau- {c.sapo_tau_neg:g})"
    if c.eps_clip is None:
        text = "none"
    elif c.objective == "cispo":
        text = f"IS weight clipped to {_bounds(c.eps_clip, c.eps_clip_higher)}, stop-gradient"
    else:
        scope = "sequence" if c.objective == "gspo" else "token"
        text = f"{scope} ratio in {_bounds(c.eps_clip, c.eps_clip_higher)}"
    return text + (f", dual clip {c.c_clip:g}" if c.c_clip is not None else "")


def kl_term(c: AlgorithmConfig) -> str:
    if c.objective == "dpo":
        return f"implicit (beta {c.dpo_beta:g}, {c.dpo_loss_type})"
    terms = [f"reward -{c.kl_ctl:g} {c.kl_estimator}"] if c.kl_ctl > 0 else []
    terms += [f"loss +{c.kl_loss_coef:g} {c.kl_loss_estimator}"] if c.kl_loss_coef > 0 else []
    terms += [f"loss +{c.distill_topk_coef:g} KL(teacher top-{c.distill_topk} || student)"] if c.distill_topk else []
    return ", ".join(terms) or "off"


def off_policy(c: AlgorithmConfig) -> str:
    if c.objective in ("dpo", "sft"):
        return "-"
    if not c.use_decoupled_loss:
        return "none (ratio to pi_behav)"
    if c.behav_imp_weight_metric == "binary_kl":
        return (f"pi_prox/pi_behav per token, mask where binary KL(pi_prox(y) || pi_behav(y)) per "
                f"{c.behav_imp_weight_level} > {c.behav_binary_kl_cap:g}")
    low = 0 if c.behav_imp_weight_floor is None else c.behav_imp_weight_floor
    high = "inf" if c.behav_imp_weight_cap is None else f"{c.behav_imp_weight_cap:g}"
    text = f"pi_prox/pi_behav per {c.behav_imp_weight_level}, {c.behav_imp_weight_mode} outside [{low:g}, {high}]"
    return text + (f", M2PO mask m2 < {c.m2_threshold:g}" if c.m2_threshold is not None else "")


def aggregation(c: AlgorithmConfig) -> str:
    if c.objective == "dpo":
        return "mean over pairs of " + ("per-token mean log-probs" if c.dpo_loss_type == "ipo" else "summed log-probs")
    return c.loss_agg


def describe(c: AlgorithmConfig) -> tuple[str, ...]:
    """One ``--list`` row: the cells under ``COLUMNS``."""
    return advantage(c), aggregation(c), clipping(c), kl_term(c), off_policy(c)
