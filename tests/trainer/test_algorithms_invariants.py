"""Invariants of the algorithm matrix, presets, configuration errors and ``--list``."""

import pytest
import torch

from services.trainer.algorithms import (
    ONLINE_PRESETS,
    PRESETS,
    AlgorithmConfig,
    aggregate,
    drgrpo_advantages,
    grpo_advantages,
    gspo_loss,
    kl_reward_penalty,
    liteppo_advantages,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)
from services.trainer.algorithms.__main__ import main

B, T = 6, 5


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i, (start, end) in enumerate([(1, 5), (2, 4), (0, 5), (3, 5), (1, 2), (2, 5)]):
        mask[i, start:end] = 1  # prompt before `start`, padding after `end`
    behav = -torch.rand(B, T, generator=g) * 2 - 0.1
    prox = behav + torch.randn(B, T, generator=g) * 0.3
    logp = (prox + torch.randn(B, T, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(B, T, generator=g)
    versions = torch.where(mask.bool(), torch.randint(0, 4, (B, T), generator=g), -1)
    return dict(
        logp=logp,
        prox_logp=prox,
        behav_logp=behav,
        advantages=adv,
        loss_mask=mask,
        versions=versions,
        current_version=3,
    )


def _build(name: str, **overrides):
    return AlgorithmConfig.from_preset(name, max_new_tokens=T, **overrides).build()


def test_grpo_advantages_sum_to_zero_within_each_group():
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=g)
    group_ids = torch.tensor([4, 9, 4, 2, 9, 2, 4, 9, 2, 4, 9, 2])
    mask = torch.ones(12, 3)
    adv = _build("grpo").advantages(rewards, group_ids, mask)
    assert torch.allclose(adv, adv[:, :1].expand_as(adv))  # one value per sequence, on every trained token
    for gid in group_ids.unique():
        assert adv[group_ids == gid, 0].sum().abs() < 1e-5


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("grpo", grpo_advantages),
        ("drgrpo", drgrpo_advantages),
        ("liteppo", liteppo_advantages),
        ("rloo", rloo_advantages),
    ],
)
def test_preset_advantages_are_the_named_estimator_on_every_trained_token(name, fn):
    batch = _batch()
    rewards, group_ids = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2]), torch.tensor([0, 0, 0, 1, 1, 1])
    adv = _build(name).advantages(rewards, group_ids, batch["loss_mask"])
    expected = fn(rewards, group_ids).unsqueeze(-1) * batch["loss_mask"]
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_preset_matches_the_function():
    batch = _batch()
    rewards, mask = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2]), batch["loss_mask"]
    ref = batch["behav_logp"] + 0.2 * torch.randn(B, T)
    adv = _build("reinforce_pp").advantages(rewards, torch.arange(B), mask, old_logp=batch["behav_logp"], ref_logp=ref)
    kl = kl_reward_penalty(batch["behav_logp"], ref, mask, kl_ctl=0.001, estimator="k1")
    torch.testing.assert_close(adv, reinforce_pp_advantages(rewards, mask, kl_penalty=kl))
    with pytest.raises(ValueError, match="ref_logp"):
        _build("reinforce_pp").advantages(rewards, torch.arange(B), mask)


def test_decoupled_loss_equals_ppo_when_proximal_equals_behaviour():
    batch = _batch()
    batch["prox_logp"] = batch["behav_logp"]
    loss, _ = _build("grpo").policy_loss(**batch)
    (grad,) = torch.autograd.grad(loss, batch["logp"])
    terms = ppo_clip_loss(batch["logp"], batch["behav_logp"], batch["advantages"], batch["loss_mask"], eps_clip=0.2)
    expected = aggregate(terms.loss, batch["loss_mask"])
    (expected_grad,) = torch.autograd.grad(expected, batch["logp"])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_loglinear_with_only_fresh_tokens_equals_recompute_of_behaviour():
    batch = _batch()
    batch["versions"] = torch.where(batch["loss_mask"].bool(), 3, -1)  # every token from the current version
    fresh = _build("grpo").policy_loss(**{**batch, "prox_logp": batch["behav_logp"]})[0]
    approx = _build("grpo", prox_logp_method="loglinear").policy_loss(**{**batch, "prox_logp": None})[0]
    torch.testing.assert_close(approx, fresh)


def test_gspo_equals_token_ppo_on_one_token_sequences():
    batch = _batch()
    one = torch.zeros(B, T)
    one[torch.arange(B), torch.tensor([1, 2, 0, 3, 1, 4])] = 1
    g_terms = gspo_loss(batch["logp"], batch["prox_logp"], batch["advantages"], one, eps_clip=0.2, eps_clip_higher=0.2)
    p_terms = ppo_clip_loss(batch["logp"], batch["prox_logp"], batch["advantages"], one, eps_clip=0.2)
    torch.testing.assert_close(g_terms.loss, p_terms.loss)
    # and through the presets (GSPO aggregates per sequence, which is the token mean here)
    gspo = _build("gspo", eps_clip=0.2, eps_clip_higher=0.2).policy_loss(**{**batch, "loss_mask": one})[0]
    grpo = _build("grpo").policy_loss(**{**batch, "loss_mask": one})[0]
    torch.testing.assert_close(gspo, grpo)
    g1, g2 = (torch.autograd.grad(x, batch["logp"])[0] for x in (gspo, grpo))
    torch.testing.assert_close(g1, g2)


def test_dapo_with_symmetric_clip_equals_ppo():
    batch = _batch()
    dapo = _build("dapo", eps_clip_higher=0.2).policy_loss(**batch)[0]
    grpo = _build("grpo").policy_loss(**batch)[0]
    torch.testing.assert_close(dapo, grpo)
    # and clip-higher changes it when some ratio exceeds 1.2 with a positive advantage
    assert not torch.allclose(_build("dapo").policy_loss(**batch)[0], grpo)


@pytest.mark.parametrize("name", ONLINE_PRESETS)
def test_prompt_and_padding_tokens_never_contribute(name):
    batch = _batch()
    algo = _build(name, entropy_coef=0.01, kl_loss_coef=0.1)  # exercise every per-token term
    entropy = torch.rand(B, T, requires_grad=True)
    ref = batch["behav_logp"] - 0.1
    teacher_kl = torch.rand(B, T) if algo.config.distill_topk else None   # gkd's per-token term
    clean, _ = algo.policy_loss(**batch, entropy=entropy, ref_logp=ref, teacher_kl=teacher_kl)
    clean_grad, clean_entropy_grad = torch.autograd.grad(clean, (batch["logp"], entropy))
    off = ~batch["loss_mask"].bool()
    dirty = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    for key in ("logp", "prox_logp", "behav_logp", "advantages"):
        dirty[key][off] = float("nan")
    dirty["logp"].requires_grad_()
    dirty["versions"][off] = 10**6
    entropy_dirty = entropy.detach().clone()
    entropy_dirty[off] = float("nan")
    entropy_dirty.requires_grad_()
    ref_dirty = ref.clone()
    ref_dirty[off] = float("inf")
    kl_dirty = None
    if teacher_kl is not None:
        kl_dirty = teacher_kl.clone()
        kl_dirty[off] = float("nan")
    loss, stats = algo.policy_loss(**dirty, entropy=entropy_dirty, ref_logp=ref_dirty, teacher_kl=kl_dirty)
    grad, entropy_grad = torch.autograd.grad(loss, (dirty["logp"], entropy_dirty))
    torch.testing.assert_close(loss, clean)
    assert torch.all(grad[off] == 0) and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, clean_grad)
    torch.testing.assert_close(entropy_grad, clean_entropy_grad)
    assert all(v == v for v in stats.values())  # no NaN statistics
    # advantages: zero off the mask, and garbage there (values, log-probs) changes nothing
    rewards, group_ids = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2]), torch.tensor([0, 0, 0, 1, 1, 1])
    values = torch.rand(B, T)
    kw = dict(values=values, old_logp=batch["behav_logp"], ref_logp=ref)
    adv = algo.advantages(rewards, group_ids, batch["loss_mask"], **kw)
    values[off], kw["old_logp"], kw["ref_logp"] = float("nan"), dirty["behav_logp"], ref_dirty
    torch.testing.assert_close(algo.advantages(rewards, group_ids, batch["loss_mask"], **kw), adv)
    assert torch.all(adv[off] == 0)


def test_gradients_are_zero_where_the_clip_is_active():
    # tokens: (A>0, u=1.5) clipped, (A<0, u=0.5) clipped, (A>0, u=0.5) and (A<0, u=1.5) not clipped
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = ppo_clip_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4), eps_clip=0.2)
    out.loss.sum().backward()
    assert out.clipped.tolist() == [[True, True, False, False]]
    assert logp.grad[0, :2].eq(0).all() and logp.grad[0, 2:].ne(0).all()
    # dual clip: A<0 with u=4 and c_clip=3 is capped -> no gradient
    logp = torch.log(torch.tensor([[4.0]])).requires_grad_()
    ppo_clip_loss(
        logp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), eps_clip=0.2, c_clip=3.0
    ).loss.sum().backward()
    assert logp.grad.eq(0).all()
    # GSPO: a sequence whose (geometric-mean) ratio is clipped gives no gradient to any of its tokens
    logp = torch.log(torch.tensor([[2.0, 1.5], [1.0, 1.0]])).requires_grad_()
    gspo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2), eps_clip=0.2).loss.sum().backward()
    assert logp.grad[0].eq(0).all() and logp.grad[1].ne(0).all()


def test_masked_tokens_count_in_the_denominator():
    batch = _batch()
    _, stats = _build("grpo", behav_imp_weight_cap=1.05).policy_loss(**batch)
    assert 0 < stats["masked_fraction"] < 1
    assert stats["tokens"] == batch["loss_mask"].sum()


# ---------------------------------------------------------------- presets and config


def test_every_preset_builds_and_lists(capsys):
    assert set(PRESETS) >= {
        "ppo",
        "grpo",
        "drgrpo",
        "dapo",
        "liteppo",
        "rloo",
        "reinforce_pp",
        "gspo",
        "sapo",
        "cispo",
        "m2po",
        "dpo",
        "sft",
    }
    for name in PRESETS:
        cfg = AlgorithmConfig.from_preset(name, max_new_tokens=1024)
        assert cfg.preset == name and cfg.build().config is cfg
    main(["--list"])
    out = capsys.readouterr().out
    for name, settings in PRESETS.items():
        assert f"\n{name} " in f"\n{out}"
        for key, value in settings.items():
            assert f"{key}={value}" in out


def test_overrides_apply():
    cfg = AlgorithmConfig.from_preset("grpo", eps_clip=0.3, behav_imp_weight_cap=3.0)
    assert (cfg.eps_clip, cfg.behav_imp_weight_cap, cfg.reward_norm_std) == (0.3, 3.0, "group")
    assert _build("ppo").needs_critic and _build("reinforce_pp").needs_reference and _build("dpo").needs_reference
    assert _build("grpo").needs_prox_logp and not _build("grpo", prox_logp_method="loglinear").needs_prox_logp
    assert not _build("sapo").needs_prox_logp and _build("sft").is_offline


@pytest.mark.parametrize(
    ("preset", "overrides", "named"),
    [
        ("nope", {}, "nope"),
        ("grpo", {"eps_clipp": 0.2}, "eps_clipp"),
        ("grpo", {"eps_clip": -0.1}, "eps_clip"),
        ("grpo", {"loss_agg": "sum"}, "loss_agg"),
        ("grpo", {"c_clip": 0.5}, "c_clip"),
        ("sapo", {"c_clip": 3.0}, "c_clip"),
        ("cispo", {"c_clip": 3.0}, "c_clip"),
        ("grpo", {"objective": "trpo"}, "objective"),
        ("grpo", {"behav_imp_weight_floor": 6.0}, "behav_imp_weight_floor"),
        ("sapo", {"m2_threshold": 0.04}, "m2_threshold"),
        ("grpo", {"gae_lambda": 1.5}, "gae_lambda"),
        ("dpo", {"use_critic": True}, "use_critic"),
    ],
)
def test_user_mistakes_are_value_errors_naming_the_field(preset, overrides, named):
    with pytest.raises(ValueError, match=named):
        AlgorithmConfig.from_preset(preset, **overrides)


def test_overlong_penalty_needs_max_new_tokens_at_build():
    with pytest.raises(ValueError, match="max_new_tokens"):
        AlgorithmConfig.from_preset("dapo").build()
    with pytest.raises(ValueError, match="overlong_tokens"):
        AlgorithmConfig.from_preset("dapo", max_new_tokens=8, overlong_tokens=9).build()


def test_dapo_pipeline_by_hand():
    # max_new_tokens 10, overlong_tokens 4: row 0 has 10 tokens -> penalty -1 -> reward 1 - 1 = 0;
    # row 1 has 5 tokens -> no penalty -> 1. Group norm: mean 0.5, unbiased std 0.707107 -> -+0.707107
    algo = AlgorithmConfig.from_preset("dapo", max_new_tokens=10, overlong_tokens=4).build()
    mask = torch.zeros(2, 10)
    mask[0, :] = 1
    mask[1, :5] = 1
    adv = algo.advantages(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), mask)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-0.707107, 0.707107]), atol=1e-4, rtol=0)
    assert adv[1, 5:].eq(0).all()
    # dynamic sampling: the raw rewards {1, 1} are uniform, so the group is dropped
    report = algo.filter_groups_report(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert report.keep.tolist() == [False, False, True, True] and report.num_groups_dropped == 1
    assert _build("grpo").filter_groups(torch.ones(4), torch.tensor([0, 0, 1, 1])).all()
