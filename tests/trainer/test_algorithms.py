"""Formula tests: every function against values computed by hand (derivations in the comments)."""

import math

import pytest
import torch

from services.trainer.algorithms import (
    aggregate,
    behaviour_weights,
    cispo_loss,
    decoupled_ppo_loss,
    dpo_loss,
    drgrpo_advantages,
    filter_uniform_groups,
    gae,
    grpo_advantages,
    gspo_loss,
    kl_estimate,
    kl_reward_penalty,
    liteppo_advantages,
    loglinear_prox_logp,
    loss_weight,
    m2po_mask,
    overlong_penalty,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    sapo_loss,
    sft_loss,
    shape_rewards,
    staleness_histogram,
    token_rewards,
    value_loss,
    whiten,
)

LN = math.log


def close(actual, expected, tol=1e-4):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.tensor(expected).float(), atol=tol, rtol=0)


# ---------------------------------------------------------------- shaping


def test_shape_rewards_bias_scale_clip():
    # (1 + 0.5) * 2 = 3;  (-30 + 0.5) * 2 = -59 -> clipped to -20;  (0.5 + 0.5) * 2 = 2
    close(shape_rewards(torch.tensor([1.0, -30.0, 0.5]), bias=0.5, scale=2.0, clip=20.0), [3.0, -20.0, 2.0])


def test_overlong_penalty():
    # L_max = 10, L_cache = 4 -> penalty starts after 6 tokens: -(len - 6) / 4 * factor, capped at 0
    lengths = torch.tensor([5, 6, 8, 10])
    close(overlong_penalty(lengths, max_new_tokens=10, overlong_tokens=4), [0.0, 0.0, -0.5, -1.0])
    close(overlong_penalty(lengths, max_new_tokens=10, overlong_tokens=4, factor=0.5), [0.0, 0.0, -0.25, -0.5])


def test_kl_estimators():
    # log r = ln 0.5 - ln 0.25 = ln 2 = 0.693147
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    close(kl_estimate(logp, ref, "k1"), [0.693147])
    close(kl_estimate(logp, ref, "k2"), [0.240227])  # 0.5 * 0.693147^2
    close(kl_estimate(logp, ref, "k3"), [0.193147])  # e^-ln2 - 1 + ln2 = 0.5 - 1 + 0.693147
    close(kl_estimate(torch.tensor([20.0]), torch.tensor([0.0]), "k1"), [10.0])  # clamped to +-10
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_kl_reward_penalty_only_on_trained_tokens():
    # -0.1 * k1 = -0.1 * ln 2 = -0.0693147 where the mask is 1, else 0
    logp = torch.full((1, 3), LN(0.5))
    ref = torch.full((1, 3), LN(0.25))
    out = kl_reward_penalty(logp, ref, torch.tensor([[0, 1, 1]]), kl_ctl=0.1, estimator="k1")
    close(out, [[0.0, -0.0693147, -0.0693147]])


# ---------------------------------------------------------------- advantages

REWARDS = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0])
GROUPS = torch.tensor([7, 3, 7, 7, 3, 7])  # group 7 = {1, 0, 0, 1}, group 3 = {2, 4}


def test_grpo_advantages():
    # group 7: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350 -> +-0.5 / 0.577350 = +-0.866025
    # group 3: mean 3, unbiased std sqrt(2 / 1) = 1.414214      -> -+1 / 1.414214 = -+0.707107
    close(grpo_advantages(REWARDS, GROUPS), [0.866025, -0.707107, -0.866025, -0.866025, 0.707107, 0.866025])


def test_drgrpo_advantages():
    # r - group mean: group 7 mean 0.5, group 3 mean 3
    close(drgrpo_advantages(REWARDS, GROUPS), [0.5, -1.0, -0.5, -0.5, 1.0, 0.5])


def test_rloo_advantages():
    # r_i - mean of the others: group 7: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3; group 3: 2 - 4 = -2, 4 - 2 = 2
    close(rloo_advantages(REWARDS, GROUPS), [2 / 3, -2.0, -2 / 3, -2 / 3, 2.0, 2 / 3])


def test_liteppo_advantages():
    # batch of raw rewards: mean 8/6, sum of squared deviations 102/9, unbiased var 102/45 -> std 1.505545
    # (r - group mean) / 1.505545: 0.5 -> 0.332106, 1 -> 0.664211
    close(liteppo_advantages(REWARDS, GROUPS), [0.332106, -0.664211, -0.332106, -0.332106, 0.664211, 0.332106])


def test_token_rewards_on_last_trained_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    close(token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask), [[0, 0, 2, 0], [0, 0, 0, 3], [0, 0, 0, 0]])


def test_gae_with_critic():
    # gamma 0.9, lambda 0.5, rewards [0, 0, 1], values [0.5, 0.6, 0.8], V after the end = 0
    # t=2: delta = 1 - 0.8 = 0.2                    A = 0.2
    # t=1: delta = 0.9 * 0.8 - 0.6 = 0.12           A = 0.12 + 0.45 * 0.2 = 0.21
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04           A = 0.04 + 0.45 * 0.21 = 0.1345
    # returns = A + V = [0.6345, 0.81, 1.0]
    adv, ret = gae(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3), gamma=0.9, lam=0.5
    )
    close(adv, [[0.1345, 0.21, 0.2]])
    close(ret, [[0.6345, 0.81, 1.0]])
    # an untrained position (tool output) in the middle is skipped; its garbage never enters
    adv, _ = gae(
        torch.tensor([[0.0, 5.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 9.0, 0.6, 0.8]]),
        torch.tensor([[1, 0, 1, 1]]),
        gamma=0.9,
        lam=0.5,
    )
    close(adv, [[0.1345, 0.0, 0.21, 0.2]])


def test_gae_without_critic_is_reward_to_go():
    rewards, mask = torch.tensor([[0.0, 0.5, 7.0, 1.0]]), torch.tensor([[1, 1, 0, 1]])
    # gamma 1: sums of future trained rewards: [0 + 0.5 + 1, 0.5 + 1, -, 1]
    close(gae(rewards, None, mask)[0], [[1.5, 1.5, 0.0, 1.0]])
    # gamma 0.5: A3 = 1, A1 = 0.5 + 0.5 * 1 = 1, A0 = 0 + 0.5 * 1 = 0.5
    close(gae(rewards, None, mask, gamma=0.5)[0], [[0.5, 1.0, 0.0, 1.0]])


def test_whiten():
    # trained values [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]; the padded 99 is ignored
    close(whiten(torch.tensor([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]])), [[-1.0, 0.0, 1.0, 0.0]])


def test_reinforce_pp_advantages():
    # row 0: reward 1 on token 1, KL rewards [-0.1, -0.2] -> token rewards [-0.1, 0.8] -> returns [0.7, 0.8]
    # row 1: reward 0 on token 2, KL rewards [0, -0.1, 0] -> returns [-0.1, -0.1, 0]
    # whiten [0.7, 0.8, -0.1, -0.1, 0]: mean 0.26, squared deviations sum 0.812, unbiased var 0.203,
    # std 0.450555 -> 0.44/s = 0.976573, 0.54/s = 1.198522, -0.36/s = -0.799014, -0.26/s = -0.577066
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = torch.tensor([[-0.1, -0.2, 0.0], [0.0, -0.1, 0.0]])
    out = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, kl_penalty=kl)
    close(out, [[0.976573, 1.198522, 0.0], [-0.799014, -0.799014, -0.577066]])


# ---------------------------------------------------------------- policy losses


def _lp(ratios):
    """log-probs whose ratio to zero log-probs is the given ratio."""
    return torch.tensor([[LN(r) for r in ratios]], requires_grad=True)


def test_ppo_clip_loss():
    # eps 0.2, four tokens (A, ratio):
    # ( 1, 1.5): max(-1.5, -1.2) = -1.2 clipped   ( 1, 0.5): max(-0.5, -0.8) = -0.5
    # (-1, 1.5): max( 1.5,  1.2) =  1.5           (-1, 0.5): max( 0.5,  0.8) =  0.8 clipped
    logp, adv = _lp([1.5, 0.5, 1.5, 0.5]), torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), eps_clip=0.2)
    close(out.loss, [[-1.2, -0.5, 1.5, 0.8]])
    assert out.clipped.tolist() == [[True, False, False, True]]
    close(aggregate(out.loss, torch.ones(1, 4)), 0.15)  # (-1.2 - 0.5 + 1.5 + 0.8) / 4
    # clip-higher 0.28: the first token is clipped at 1.28 instead
    close(
        ppo_clip_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), eps_clip=0.2, eps_clip_higher=0.28).loss[0, 0],
        -1.28,
    )


def test_dual_clip():
    # A = -1, ratio 4: max(4, 1.2) = 4, dual-clipped to c * |A| = 3
    out = ppo_clip_loss(
        _lp([4.0]), torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1), eps_clip=0.2, c_clip=3.0
    )
    close(out.loss, [[3.0]])
    assert out.dual_clipped.tolist() == [[True]]


def test_gspo_loss():
    # row 0: log ratios [ln 2, 0] -> s = exp(ln2 / 2) = 1.414214, A = 1: max(-1.414, -1.2) = -1.2 on both tokens
    # row 1: log ratios [ln 0.9, ln 0.9] -> s = 0.9, A = -2: max(1.8, 1.8) = 1.8 on both tokens
    logp = torch.tensor([[LN(2.0), 0.0], [LN(0.9), LN(0.9)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    out = gspo_loss(logp, torch.zeros(2, 2), adv, torch.ones(2, 2), eps_clip=0.2, eps_clip_higher=0.2)
    close(out.loss, [[-1.2, -1.2], [1.8, 1.8]])
    close(aggregate(out.loss, torch.ones(2, 2), "seq_mean_token_mean"), 0.3)  # (-1.2 + 1.8) / 2


def test_sapo_loss_and_gradient():
    # tau_pos 1, tau_neg 1.05, g = 4/tau * sigmoid(tau * (r - 1))
    # (A=1, r=1): g = 4 * 0.5 = 2 -> -2;  (A=-1, r=1): g = 4/1.05 * 0.5 = 1.904762 -> +1.904762
    # (A=1, r=e^0.5=1.648721): sigmoid(0.648721) = 1 / (1 + 0.522714) = 0.656722 -> g = 2.626889 -> -2.626889
    logp = torch.tensor([[0.0, 0.0, 0.5]], requires_grad=True)
    out = sapo_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3))
    close(out.loss, [[-2.0, 1.904762, -2.626889]])
    # at r = 1: d/dlogp = -A * 4/tau * tau * sigmoid'(0) * r = -A * 4 * 0.25 = -A (the policy gradient)
    out.loss[0, :2].sum().backward()
    close(logp.grad[0, :2], [-1.0, 1.0])


def test_cispo_loss_keeps_gradient_of_clipped_tokens():
    # token 0: r = 1.5 clipped to 1.28, A = 2, logp = -1: loss = -1.28 * 2 * (-1) = 2.56, dL/dlogp = -2.56
    # token 1: r = 0.5 clipped to 0.8, A = -1, logp = -2: loss = -0.8 * (-1) * (-2) = -1.6, dL/dlogp = 0.8
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - LN(1.5), -2.0 - LN(0.5)]])
    out = cispo_loss(logp, old, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), eps_clip=0.2, eps_clip_higher=0.28)
    close(out.loss, [[2.56, -1.6]])
    assert out.clipped.tolist() == [[True, True]]
    out.loss.sum().backward()
    close(logp.grad, [[-2.56, 0.8]])


def test_decoupled_ppo_loss():
    # token 0: w = pi_prox/pi_behav = 2, u = 1.1, A = 1:   -min(1.1, 1.1) * 2           = -2.2
    # token 1: w = 8 > cap 5 -> dropped (0), but still counted in the token-mean denominator
    # token 2: w = 0.5, u = 0.7, A = -2:  max(1.4, 1.6) = 1.6 (clipped at 0.8) * 0.5 = 0.8
    # loss = (-2.2 + 0 + 0.8) / 3 = -0.466667
    behav = torch.zeros(1, 3)
    prox = torch.tensor([[LN(2.0), LN(8.0), LN(0.5)]])
    logp = prox + torch.tensor([[LN(1.1), 0.0, LN(0.7)]])
    loss = decoupled_ppo_loss(logp, prox, behav, torch.tensor([[1.0, 1.0, -2.0]]), torch.ones(1, 3), eps_clip=0.2)
    close(loss, -0.466667)


def test_behaviour_weight_modes():
    prox, behav, mask = torch.tensor([[LN(2.0), LN(8.0), LN(0.5)]]), torch.zeros(1, 3), torch.ones(1, 3)
    # clamp (truncated IS): [2, 8 -> 5, 0.5], every token kept, 1 of 3 clamped
    out = behaviour_weights(prox, behav, mask, cap=5.0, mode="clamp")
    close(out.weight, [[2.0, 5.0, 0.5]])
    assert out.mask.all() and out.affected_fraction == pytest.approx(1 / 3)
    # IcePop band [0.6, 5] with masking: 8 and 0.5 are outside
    out = behaviour_weights(prox, behav, mask, cap=5.0, floor=0.6, mode="mask")
    assert out.mask.tolist() == [[True, False, False]]
    close(out.weight, [[2.0, 0.0, 0.0]])
    # sequence level: geometric mean exp((ln2 + 3 ln2 - ln2) / 3) = 2 for every token, inside the band
    out = behaviour_weights(prox, behav, mask, cap=5.0, floor=0.6, level="sequence")
    close(out.weight, [[2.0, 2.0, 2.0]])
    assert out.mask.all()


def test_loglinear_prox_logp():
    # current version 5; alpha = (5 - v) / (6 - v): v=5 -> 0, v=4 -> 1/2, v=3 -> 2/3; v=-1 -> 0
    # prox = behav + alpha * (logp - behav) = -1 + alpha * (-1)
    behav, logp = torch.tensor([[-1.0, -1.0, -1.0, 0.0]]), torch.tensor([[-2.0, -2.0, -2.0, -3.0]])
    out = loglinear_prox_logp(behav, logp, torch.tensor([[5, 4, 3, -1]]), current_version=5)
    close(out, [[-1.0, -1.5, -5 / 3, 0.0]])


def test_m2po_mask():
    # m2 = delta^2 = [0.01, 0.25, 0.04, 0.09] (+ an untrained token with a huge delta)
    # sorted [0.25, 0.09, 0.04, 0.01]: mean of all 0.0975, without 0.25: 0.14/3 = 0.0467,
    # without 0.25 and 0.09: 0.05/2 = 0.025 < 0.04 -> drop tokens 1 and 3
    behav = torch.tensor([[0.1, 0.5, 0.2, 0.3, 9.0]])
    keep = m2po_mask(torch.zeros(1, 5), behav, torch.tensor([[1, 1, 1, 1, 0]]), threshold=0.04)
    assert keep.tolist() == [[True, False, True, False, False]]


def test_staleness_histogram():
    versions = torch.tensor([[-1, 3, 3, 2], [5, 5, 4, -1]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    assert staleness_histogram(versions, mask, current_version=5) == {0: 2, 1: 1, 2: 2, 3: 1}


# ---------------------------------------------------------------- aggregation, value, offline, sampling


def test_aggregation_modes():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row trains nothing
    close(aggregate(values, mask, "token_mean"), 2.5)  # (1 + 2 + 3 + 4) / 4
    close(aggregate(values, mask, "seq_mean_token_mean"), 3.0)  # (2 + 4) / 2
    close(aggregate(values, mask, "seq_mean_token_sum"), 5.0)  # (6 + 4) / 2
    close(aggregate(values, mask, "seq_mean_token_sum_norm", norm_constant=10), 0.5)  # 10 / (2 * 10)
    close(aggregate(values, mask, "seq_mean_token_sum_norm"), 10 / 6)  # constant = T = 3
    assert loss_weight(mask, "token_mean") == 4 and loss_weight(mask, "seq_mean_token_sum") == 2


def test_value_loss_clipped():
    # token 0: V=1, V_old=0.5, R=2: 0.5 * 1^2 = 0.5; clipped V = 0.5 + 0.2 = 0.7: 0.5 * 1.3^2 = 0.845 -> 0.845
    # token 1: V=2, V_old=2, R=1: 0.5 both -> 0.5;   mean = 0.6725, clipped branch chosen on 1 of 2
    loss, stats = value_loss(
        torch.tensor([[1.0, 2.0]]),
        torch.tensor([[0.5, 2.0]]),
        torch.tensor([[2.0, 1.0]]),
        torch.ones(1, 2),
        eps_clip=0.2,
    )
    close(loss, 0.6725)
    assert stats["value_clip_fraction"] == pytest.approx(0.5)


def test_dpo_and_ipo():
    # h = (pi_c - pi_r) - (ref_c - ref_r) = (-1 + 3) - 0 = 2
    args = (torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))
    loss, stats = dpo_loss(*args, beta=0.5)
    close(loss, 0.313262)  # -log sigmoid(0.5 * 2) = log(1 + e^-1) = log 1.367879
    assert stats["dpo_margin"] == pytest.approx(1.0) and stats["dpo_accuracy"] == 1.0
    close(dpo_loss(*args, beta=0.5, loss_type="ipo")[0], 1.0)  # (2 - 1 / (2 * 0.5))^2


def test_sft_loss():
    close(sft_loss(torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[1, 1, 0]])), 1.5)  # (1 + 2) / 2


def test_filter_uniform_groups():
    # group 0 {1, 1} and group 2 {0.5, 0.5} are uniform, group 3 has one sample: only group 1 is kept
    result = filter_uniform_groups(
        torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 3.0]), torch.tensor([0, 0, 1, 1, 2, 2, 3])
    )
    assert result.keep.tolist() == [False, False, True, True, False, False, False]
    assert (result.num_groups, result.num_groups_dropped, result.num_samples_dropped) == (4, 3, 5)
