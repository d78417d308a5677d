"""Review fixes: the dual clip per objective, the IcePop and KPop presets, IPO's length normalisation, ``--list``."""

from __future__ import annotations

import re

import pytest
import torch

from services.trainer.algorithms import PRESETS, AlgorithmConfig, gspo_loss
from services.trainer.algorithms.__main__ import main
from services.trainer.algorithms.presets import dynamic_sampling
from services.trainer.algorithms.summary import COLUMNS, describe


def test_gspo_dual_clip_caps_a_negative_advantage_sequence():
    # one row whose sequence ratio is 4 with A = -1: the dual clip at 3 caps it (no gradient), no c_clip does not
    def grad(c_clip):
        logp = torch.log(torch.tensor([[4.0, 4.0]])).requires_grad_()
        out = gspo_loss(logp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2), eps_clip=0.2, c_clip=c_clip)
        out.loss.sum().backward()
        return logp.grad, out.dual_clipped

    capped, dual = grad(3.0)
    assert capped.eq(0).all() and dual.all()
    free, dual = grad(None)
    assert free.ne(0).all() and not dual.any()


def test_gspo_preset_applies_c_clip_through_the_algorithm():
    algo = AlgorithmConfig.from_preset("gspo", c_clip=3.0).build()
    logp = torch.log(torch.tensor([[4.0, 4.0]]))
    _, stats = algo.policy_loss(logp=logp, prox_logp=torch.zeros(1, 2), behav_logp=torch.zeros(1, 2),
                                advantages=-torch.ones(1, 2), loss_mask=torch.ones(1, 2))
    assert stats["dual_clip_fraction"] == 1.0


def test_icepop_masks_tokens_outside_the_two_sided_band():
    # w = pi_prox / pi_behav per token: 0.4 (below the floor), 1.0, 3.0, 6.0 (above the cap)
    behav = torch.zeros(1, 4)
    prox = torch.log(torch.tensor([[0.4, 1.0, 3.0, 6.0]]))
    logp = prox.clone().requires_grad_()
    algo = AlgorithmConfig.from_preset("icepop").build()
    assert (algo.config.behav_imp_weight_floor, algo.config.behav_imp_weight_cap) == (0.5, 5.0)
    loss, stats = algo.policy_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=torch.ones(1, 4),
                                   loss_mask=torch.ones(1, 4))
    loss.backward()
    assert logp.grad[0].ne(0).tolist() == [False, True, True, False]
    assert stats["behav_imp_weight_affected_fraction"] == 0.5
    # grpo has no floor: the 0.4 token trains
    logp = prox.clone().requires_grad_()
    AlgorithmConfig.from_preset("grpo").build().policy_loss(
        logp=logp, prox_logp=prox, behav_logp=behav, advantages=torch.ones(1, 4), loss_mask=torch.ones(1, 4)
    )[0].backward()
    assert logp.grad[0].ne(0).tolist() == [True, True, True, False]


def test_kpop_masks_by_binary_kl_not_by_ratio():
    # pi_behav -> pi_prox per token: a rare token 1e-6 -> 1e-4 (ratio 100, binary KL 4e-4), 0.5 -> 0.45 (KL 5e-3),
    # 0.5 -> 0.2 (ratio 0.4, KL 0.19), 0.8 -> 0.999 (ratio 1.25, KL 0.22: the rest's mass fell 200-fold)
    behav = torch.log(torch.tensor([[1e-6, 0.5, 0.5, 0.8]]))
    prox = torch.log(torch.tensor([[1e-4, 0.45, 0.2, 0.999]]))
    algo = AlgorithmConfig.from_preset("kpop").build()
    logp = prox.clone().requires_grad_()
    loss, stats = algo.policy_loss(logp=logp, prox_logp=prox, behav_logp=behav, advantages=torch.ones(1, 4),
                                   loss_mask=torch.ones(1, 4))
    loss.backward()
    assert logp.grad[0].ne(0).tolist() == [True, True, False, False]
    assert stats["behav_imp_weight_affected_fraction"] == 0.5
    # the rare token keeps its uncapped weight: its gradient is 100x a fresh token's (token mean of 4, ratio 1)
    assert logp.grad[0, 0].item() == pytest.approx(-100.0 / 4, rel=1e-3)
    # icepop's ratio band decides the other way on the rare token and on 0.8 -> 0.999
    logp = prox.clone().requires_grad_()
    AlgorithmConfig.from_preset("icepop").build().policy_loss(
        logp=logp, prox_logp=prox, behav_logp=behav, advantages=torch.ones(1, 4), loss_mask=torch.ones(1, 4)
    )[0].backward()
    assert logp.grad[0].ne(0).tolist() == [False, True, False, True]
    # sequence level: the row's mean binary KL (0.104) over the cap masks the whole row
    seq = AlgorithmConfig.from_preset("kpop", behav_imp_weight_level="sequence").build()
    _, stats = seq.policy_loss(logp=prox.clone(), prox_logp=prox, behav_logp=behav, advantages=torch.ones(1, 4),
                               loss_mask=torch.ones(1, 4))
    assert stats["behav_imp_weight_affected_fraction"] == 1.0


@pytest.mark.parametrize("overrides, field", [
    ({"behav_imp_weight_cap": 5.0}, "behav_imp_weight_cap=5.0 bounds the ratio"),
    ({"behav_imp_weight_mode": "clamp"}, "behav_imp_weight_mode='clamp'"),
    ({"behav_binary_kl_cap": None}, "behav_binary_kl_cap must be set"),
    ({"behav_binary_kl_cap": -1.0}, "behav_binary_kl_cap=-1.0 must be > 0"),
    ({"behav_imp_weight_metric": "ratio"}, "behav_binary_kl_cap=0.1 needs behav_imp_weight_metric='binary_kl'"),
])
def test_kpop_settings_that_do_not_fit_are_refused_naming_them(overrides, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        AlgorithmConfig.from_preset("kpop", **overrides)


def test_ipo_uses_length_normalised_sequence_logps():
    logp = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    ipo = AlgorithmConfig.from_preset("dpo", dpo_loss_type="ipo").build()
    dpo = AlgorithmConfig.from_preset("dpo").build()
    assert ipo.sequence_logp(logp, mask).tolist() == [-2.0, -1.0]
    assert dpo.sequence_logp(logp, mask).tolist() == [-6.0, -2.0]
    # the same per-token margin over 2 or 8 tokens: the same IPO loss (summed log-probs would differ 4x)

    def loss(length: int) -> float:
        m = torch.ones(1, length)
        chosen, rejected, ref = ipo.sequence_logp(torch.full((1, length), -1.0), m), ipo.sequence_logp(
            torch.full((1, length), -1.5), m), ipo.sequence_logp(torch.full((1, length), -1.2), m)
        return float(ipo.preference_loss(chosen, rejected, ref, ref)[0])

    assert abs(loss(2) - loss(8)) < 1e-6


def test_list_shows_what_each_preset_is(capsys):
    main(["--list"])
    out = capsys.readouterr().out
    header, *rows = out.split("\n\n")[0].splitlines()
    assert header.split()[0] == "preset" and all(col in header for col in COLUMNS)
    assert [row.split()[0] for row in rows] == list(PRESETS)
    table = dict(zip(PRESETS, rows, strict=True))
    assert "reward - group mean, / group std" in table["grpo"] and " off " in table["grpo"]
    assert "mask outside [0.5, 5]" in table["icepop"] and "reward -0.001 k1" in table["reinforce_pp"]
    assert "dual clip 3" in " ".join(describe(AlgorithmConfig.from_preset("gspo", c_clip=3.0)))
    grpo_note = next(line for line in out.splitlines() if line.startswith("grpo") and "KL" in line)
    assert "0.04" in grpo_note and "k3" in grpo_note


def test_dynamic_sampling_for_the_builder_follows_the_trainers_algorithm():
    assert dynamic_sampling("dapo", {}) and dynamic_sampling("grpo", {"dynamic_sampling": True})
    assert not dynamic_sampling("grpo", {}) and not dynamic_sampling("dapo", {"dynamic_sampling": False})
    assert not dynamic_sampling("dpo", {"dynamic_sampling": True}), "offline presets ignore it"
