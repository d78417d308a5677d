"""``Algorithm``: the configured pipeline the trainer calls (shaping -> advantages -> filter -> loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .advantages import gae, last_token_mask, normalize_rewards, token_rewards, whiten
from .aggregation import aggregate, loss_weight, masked_mean
from .losses import TokenLoss, cispo_loss, gspo_loss, ppo_clip_loss, sapo_loss, value_loss
from .offline import dpo_loss, sequence_logp, sft_loss
from .offpolicy import behaviour_weights, loglinear_prox_logp, m2po_mask, staleness
from .sampling import GroupFilter, filter_uniform_groups
from .shaping import kl_estimate, kl_reward_penalty, overlong_penalty, shape_rewards

if TYPE_CHECKING:
    from .config import AlgorithmConfig


@dataclass(slots=True)
class AdvantageResult:
    advantages: torch.Tensor  # float[B, T], zero outside the loss mask
    returns: torch.Tensor  # float[B, T], critic targets (advantages + values)
    rewards: torch.Tensor  # float[B], shaped sequence rewards (before normalisation)
    kl_penalty: torch.Tensor | None  # float[B, T], the per-token KL reward when kl_ctl > 0


class Algorithm:
    """Built by ``AlgorithmConfig.build()``; stateless, so one instance serves every step."""

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    # What the trainer must provide.
    @property
    def is_offline(self) -> bool:
        return self.config.objective in ("dpo", "sft")

    @property
    def needs_critic(self) -> bool:
        return self.config.use_critic

    @property
    def needs_reference(self) -> bool:
        c = self.config
        return (c.kl_ctl > 0 or c.kl_loss_coef > 0 or c.distill_coef > 0 or c.distill_topk > 0
                or c.objective == "dpo")

    @property
    def needs_prox_logp(self) -> bool:
        """True when the trainer must recompute log pi_prox (a no-grad forward) before the update."""
        return not self.is_offline and self.config.use_decoupled_loss and self.config.prox_logp_method == "recompute"

    def shape_rewards(
        self, rewards: torch.Tensor, *, lengths: torch.Tensor | None = None, truncated: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Overlong penalty -> bias / scale / clip -> zero for truncated outputs; float[B]."""
        c = self.config
        r = rewards.float()
        if c.overlong_penalty:
            r = r + self._overlong(lengths)
        r = shape_rewards(r, bias=c.reward_bias, scale=c.reward_scaling, clip=c.reward_clip)
        if c.mask_truncated_reward:
            if truncated is None:
                raise ValueError("mask_truncated_reward needs `truncated` (bool[B]) from the rollout")
            r = torch.where(truncated.bool(), 0.0, r)
        return r

    def normalize(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """The configured baseline and scale (group, batch or none) of rewards: float[N], one per sequence or step."""
        c = self.config
        if c.reward_norm_mean is None and c.reward_norm_std is None:
            return rewards
        return normalize_rewards(
            rewards,
            group_ids,
            mean_level=c.reward_norm_mean,
            std_level=c.reward_norm_std,
            leave_one_out=c.reward_norm_leave_one_out,
            unbiased=c.std_unbiased,
            eps=c.norm_eps,
        )

    def _overlong(self, lengths: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        assert c.max_new_tokens is not None and lengths is not None
        cache = c.overlong_tokens or max(1, c.max_new_tokens // 5)
        return overlong_penalty(
            lengths, max_new_tokens=c.max_new_tokens, overlong_tokens=cache, factor=c.overlong_penalty_factor
        )

    def process_token_rewards(
        self,
        rewards: torch.Tensor,
        group_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        step_rewards: torch.Tensor,
        step_mask: torch.Tensor,
        *,
        lengths: torch.Tensor,
        truncated: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Process supervision (DeepSeekMath, section 4.1.3): every step reward is shaped like a sequence reward
        (the overlong penalty on a row's last step, truncation zeroing all of a row's steps), normalised over
        the steps of its group (or batch) and placed on the token that ends its step, so that with discount 1
        and no critic a token's advantage is the sum of the normalised rewards of the steps from its own on.
        A row without process rewards counts its outcome reward as one step on its last trained token.

        Returns (float[B, T] token rewards, float[B] shaped rewards: the sum of each row's steps).
        """
        c = self.config
        mask = loss_mask.bool()
        last_token = last_token_mask(mask)
        ends = step_mask.bool() & mask
        bare = ~ends.any(-1, keepdim=True)
        ends = ends | (bare & last_token)
        values = torch.where(bare, rewards.float().unsqueeze(-1), step_rewards.float())[ends]
        rows = ends.nonzero()[:, 0]  # row-major, the order of values
        positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
        last_end = torch.where(ends, positions, -1).amax(-1, keepdim=True)
        is_last = (positions == last_end)[ends]
        if c.overlong_penalty:
            values = values + torch.where(is_last, self._overlong(lengths)[rows], 0.0)
        values = shape_rewards(values, bias=c.reward_bias, scale=c.reward_scaling, clip=c.reward_clip)
        if c.mask_truncated_reward:
            if truncated is None:
                raise ValueError("mask_truncated_reward needs `truncated` (bool[B]) from the rollout")
            values = torch.where(truncated.bool()[rows], 0.0, values)
        shaped = torch.zeros(mask.shape[0], device=values.device).index_add_(0, rows, values)
        normed = self.normalize(values, group_ids[rows])
        tok = torch.zeros(mask.shape, device=values.device)
        tok[ends] = normed.float()
        return tok, shaped

    def compute_advantages(
        self,
        rewards: torch.Tensor,
        group_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        old_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        step_rewards: torch.Tensor | None = None,
        step_mask: torch.Tensor | None = None,
    ) -> AdvantageResult:
        """Shaped reward -> normalisation -> per-token rewards (+KL) -> GAE -> optional whitening.

        ``lengths`` defaults to the trained-token count per row (the completion length). With
        ``reward_level: process`` the rewards are per step (``step_rewards`` on the tokens ``step_mask`` marks,
        see ``process_token_rewards``; none given: each row's outcome reward is its one step).
        """
        c = self.config
        mask = loss_mask.bool()
        lengths = mask.sum(-1) if lengths is None else lengths
        if c.reward_level == "process":
            if step_mask is None:  # no process rewards: every row's outcome is its one step
                step_rewards, step_mask = torch.zeros(mask.shape, device=mask.device), torch.zeros_like(mask)
            assert step_rewards is not None
            tok, shaped = self.process_token_rewards(
                rewards, group_ids, mask, step_rewards, step_mask, lengths=lengths, truncated=truncated
            )
        else:
            shaped = self.shape_rewards(rewards, lengths=lengths, truncated=truncated)
            tok = token_rewards(self.normalize(shaped, group_ids), mask)
        kl = None
        if c.kl_ctl > 0:
            if old_logp is None or ref_logp is None:
                raise ValueError("kl_ctl > 0 needs old_logp and ref_logp (a reference model) for the advantages")
            kl = kl_reward_penalty(old_logp, ref_logp, mask, kl_ctl=c.kl_ctl, estimator=c.kl_estimator)
            tok = tok + kl
        if c.use_critic and values is None:
            raise ValueError("use_critic needs the critic's values for the advantages")
        adv, returns = gae(tok, values if c.use_critic else None, mask, gamma=c.discount, lam=c.gae_lambda)
        if c.distill_coef > 0:
            if old_logp is None or ref_logp is None:
                raise ValueError("distill_coef > 0 needs old_logp and ref_logp (the teacher) for the advantages")
            log_ratio = (ref_logp - old_logp).detach()
            if c.distill_clip is not None:
                log_ratio = log_ratio.clamp(-c.distill_clip, c.distill_clip)
            adv = adv + torch.where(mask, c.distill_coef * log_ratio, 0.0)
        if c.adv_norm:  # after the teacher's term: whitening centres it too (a baseline: tokens the teacher likes
            adv = whiten(adv, mask, unbiased=c.std_unbiased, eps=c.norm_eps)  # more than most are pushed up)
        return AdvantageResult(adv, returns, shaped, kl)

    def advantages(
        self, rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor, **kwargs
    ) -> torch.Tensor:
        """float[B, T] advantages, zero where ``loss_mask`` is 0 (keywords as ``compute_advantages``)."""
        return self.compute_advantages(rewards, group_ids, loss_mask, **kwargs).advantages

    def filter_groups_report(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupFilter:
        if not self.config.dynamic_sampling:
            keep = torch.ones_like(group_ids, dtype=torch.bool)
            return GroupFilter(keep, int(torch.unique(group_ids).numel()), 0, 0)
        return filter_uniform_groups(rewards, group_ids)

    def filter_groups(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        """bool[B]: samples to train on (all True unless dynamic sampling is on)."""
        return self.filter_groups_report(rewards, group_ids).keep

    def loss_weight(self, loss_mask: torch.Tensor) -> int:
        """Weight of a micro-batch's loss when averaging micro-batches (see aggregation.loss_weight)."""
        return loss_weight(loss_mask, self.config.loss_agg)

    def _agg_constant(self) -> int | None:
        return self.config.loss_agg_constant or self.config.max_new_tokens

    def _objective(self, logp: torch.Tensor, centre: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> TokenLoss:
        c = self.config
        if c.objective == "ppo":
            return ppo_clip_loss(
                logp, centre, adv, mask, eps_clip=c.eps_clip, eps_clip_higher=c.eps_clip_higher, c_clip=c.c_clip
            )
        if c.objective == "gspo":
            return gspo_loss(
                logp, centre, adv, mask, eps_clip=c.eps_clip, eps_clip_higher=c.eps_clip_higher, c_clip=c.c_clip
            )
        if c.objective == "sapo":
            return sapo_loss(logp, centre, adv, mask, tau_pos=c.sapo_tau_pos, tau_neg=c.sapo_tau_neg)
        assert c.objective == "cispo", c.objective
        return cispo_loss(logp, centre, adv, mask, eps_clip=c.eps_clip, eps_clip_higher=c.eps_clip_higher)

    def resolve_prox_logp(
        self,
        logp: torch.Tensor,
        prox_logp: torch.Tensor | None,
        behav_logp: torch.Tensor,
        versions: torch.Tensor | None,
        current_version: int | None,
    ) -> torch.Tensor:
        """The recomputed prox_logp, or its log-linear approximation from per-token versions."""
        if prox_logp is not None:
            return prox_logp.detach()
        if self.config.prox_logp_method != "loglinear":
            raise ValueError("the decoupled loss needs prox_logp (or prox_logp_method='loglinear' with versions)")
        if versions is None or current_version is None:
            raise ValueError("prox_logp_method='loglinear' needs versions and current_version")
        return loglinear_prox_logp(behav_logp, logp, versions, current_version)

    def policy_loss(
        self,
        *,
        logp: torch.Tensor,
        prox_logp: torch.Tensor | None,
        behav_logp: torch.Tensor,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        versions: torch.Tensor | None = None,
        current_version: int | None = None,
        entropy: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        teacher_kl: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss and float stats. See package docstring for the objective. ``teacher_kl``: float[B, L-1], each
        position's forward KL from the teacher's top-k distribution (``distill_topk``), with its gradient."""
        c = self.config
        mask = loss_mask.bool()
        if c.objective == "sft":
            loss = sft_loss(logp, mask, c.loss_agg)
            return loss, {"loss": float(loss.detach()), "tokens": float(mask.sum())}
        if c.objective == "dpo":
            raise ValueError("the dpo objective trains on preference pairs: call preference_loss")
        stats: dict[str, float] = {}
        weight = None
        kept = mask
        if c.use_decoupled_loss:
            centre = self.resolve_prox_logp(logp, prox_logp, behav_logp, versions, current_version)
            if c.m2_threshold is not None:
                kept = m2po_mask(centre, behav_logp, mask, threshold=c.m2_threshold)
                stats["m2po_masked_fraction"] = 1.0 - float(kept.sum()) / max(int(mask.sum()), 1)
            bw = behaviour_weights(
                centre,
                behav_logp,
                kept,
                cap=c.behav_imp_weight_cap,
                floor=c.behav_imp_weight_floor,
                mode=c.behav_imp_weight_mode,
                level=c.behav_imp_weight_level,
                metric=c.behav_imp_weight_metric,  # type: ignore[arg-type]
                kl_cap=c.behav_binary_kl_cap,
            )
            weight, kept = bw.weight, bw.mask
            stats["behav_imp_weight_affected_fraction"] = bw.affected_fraction
        else:
            centre = (behav_logp if prox_logp is None else prox_logp).detach()
        terms = self._objective(logp, centre, advantages, kept)
        per_token = terms.loss if weight is None else terms.loss * weight
        if c.entropy_coef > 0:
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs the per-token entropy")
            per_token = per_token - c.entropy_coef * torch.where(mask, entropy, 0.0)
        if c.kl_loss_coef > 0:
            if ref_logp is None:
                raise ValueError("kl_loss_coef > 0 needs ref_logp from the reference model")
            # zeros off the mask, so that padding never reaches the estimator (nor its gradient)
            kl = kl_estimate(
                torch.where(mask, logp, 0.0), torch.where(mask, ref_logp.detach(), 0.0), c.kl_loss_estimator
            )
            per_token = per_token + c.kl_loss_coef * torch.where(mask, kl, 0.0)
        if c.distill_topk > 0:
            if teacher_kl is None:
                raise ValueError("distill_topk > 0 needs each position's KL from the teacher's top-k (teacher_kl)")
            per_token = per_token + c.distill_topk_coef * torch.where(mask, teacher_kl, 0.0)
        loss = aggregate(per_token, mask, c.loss_agg, norm_constant=self._agg_constant())
        stats.update(self._stats(loss, terms, logp, centre, behav_logp, mask, kept, weight))
        if teacher_kl is not None:
            stats["teacher_topk_kl"] = float(masked_mean(teacher_kl.detach().float(), mask))
        with torch.no_grad():
            if entropy is not None:
                stats["entropy"] = float(masked_mean(entropy.float(), mask))
            if ref_logp is not None:
                stats["kl_ref"] = float(masked_mean((logp - ref_logp).float(), mask))
            if versions is not None and current_version is not None:
                stale = staleness(versions, mask, current_version).float()
                stats["staleness_mean"] = float(stale.mean()) if stale.numel() else 0.0
                stats["staleness_max"] = float(stale.max()) if stale.numel() else 0.0
        return loss, stats

    @staticmethod
    @torch.no_grad()
    def _stats(
        loss: torch.Tensor,
        terms: TokenLoss,
        logp: torch.Tensor,
        centre: torch.Tensor,
        behav_logp: torch.Tensor,
        mask: torch.Tensor,
        kept: torch.Tensor,
        weight: torch.Tensor | None,
    ) -> dict[str, float]:
        n = max(int(mask.sum()), 1)
        k = kept if kept.any() else mask
        ratio = terms.ratio[k] if k.any() else torch.ones(1)
        w = weight[k] if weight is not None and k.any() else torch.ones(1)
        return {
            "loss": float(loss.detach()),
            "tokens": float(mask.sum()),
            "clip_fraction": float((terms.clipped & kept).sum()) / n,
            "dual_clip_fraction": float((terms.dual_clipped & kept).sum()) / n,
            "approx_kl": float(masked_mean((logp - centre).float(), kept)),
            "importance_weight_mean": float(ratio.mean()),
            "importance_weight_max": float(ratio.max()),
            "behav_imp_weight_mean": float(w.mean()),
            "behav_imp_weight_max": float(w.max()),
            "behav_approx_kl": float(masked_mean((centre - behav_logp).float(), mask)),
            "masked_fraction": 1.0 - float(kept.sum()) / n,
        }

    def value_loss(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped critic loss (``value_eps_clip``, ``value_loss_type``), token-mean."""
        c = self.config
        return value_loss(
            values, old_values, returns, loss_mask, eps_clip=c.value_eps_clip, loss_type=c.value_loss_type
        )

    def sequence_logp(self, logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Per-row sequence log-prob for the preference loss: summed (DPO), length-normalised (IPO)."""
        return sequence_logp(logp, loss_mask, mean=self.config.dpo_loss_type == "ipo")

    def preference_loss(
        self,
        policy_chosen: torch.Tensor,
        policy_rejected: torch.Tensor,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """DPO / IPO on per-pair sequence log-probs float[P] (from ``self.sequence_logp``)."""
        c = self.config
        return dpo_loss(
            policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=c.dpo_beta, loss_type=c.dpo_loss_type
        )
