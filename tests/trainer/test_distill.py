"""On-policy distillation (`distill`): each sampled token's advantage is the teacher's log-prob minus the
student's; the teacher is the reference checkpoint, which must share the tokenizer; a few steps on a fixed batch
bring the student's log-probs of the sampled tokens towards the teacher's."""

from __future__ import annotations

import pytest
import torch

from services.trainer.algorithms import AlgorithmConfig
from services.trainer.forward import frozen_logp
from services.trainer.models import build_tokenizer
from services.trainer.optim import OptimConfig
from services.trainer.reference import ReferenceConfig
from tests.trainer.test_trainer_engine import engine_for, make_batch, make_model_dir, make_teacher_dir


def test_the_advantage_is_the_teachers_log_prob_minus_the_students_per_token():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.1, 0.6, 0.6, 0.5]]))
    ref = torch.log(torch.tensor([[0.4, 0.6, 0.9, 0.3], [0.2, 0.3, 0.6, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    kwargs = dict(old_logp=old, ref_logp=ref)
    algo = AlgorithmConfig.from_preset("distill").build()
    adv = algo.advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, **kwargs)
    torch.testing.assert_close(adv, torch.where(mask.bool(), ref - old, 0.0))   # the verifier's reward is off
    mixed = AlgorithmConfig.from_preset("distill", reward_scaling=1.0).build()
    outcome = AlgorithmConfig.from_preset("grpo").build().advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                                                      mask)
    torch.testing.assert_close(mixed.advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, **kwargs),
                               outcome + torch.where(mask.bool(), ref - old, 0.0))
    with pytest.raises(ValueError, match="distill_coef"):
        algo.advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)



def test_the_teachers_term_can_be_bounded_and_whitened():
    """distill_clip bounds each token's log-ratio (a peaked teacher's -20 for a rare wrong token would otherwise own
    the norm-clipped gradient); adv_norm whitens after the teacher's term is in, so it is centred too."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.1, 0.6, 0.6, 0.5]]))
    ref = torch.tensor([[-20.0, -1.0, -0.1, -1.2], [-2.0, -1.0, -0.5, -0.7]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    clipped = AlgorithmConfig.from_preset("distill", distill_clip=1.0).build()
    adv = clipped.advantages(rewards, groups, mask, old_logp=old, ref_logp=ref)
    torch.testing.assert_close(adv, torch.where(mask.bool(), (ref - old).clamp(-1.0, 1.0), 0.0))
    assert float(adv[0, 0]) == -1.0 and 0 < float(adv[0, 1]) < 1.0, "only the far tail is cut"
    whitened = AlgorithmConfig.from_preset("distill", adv_norm=True).build()
    adv = whitened.advantages(rewards, groups, mask, old_logp=old, ref_logp=ref)[mask.bool()]
    assert abs(float(adv.mean())) < 1e-5 and abs(float(adv.std()) - 1.0) < 1e-3
    raw = (ref - old)[mask.bool()]
    assert torch.equal(adv.argsort(), raw.argsort()), "whitening keeps the tokens' order"
    with pytest.raises(ValueError, match="distill_clip"):
        AlgorithmConfig.from_preset("distill", distill_clip=0.0)

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    student = make_model_dir(tmp_path_factory.mktemp("student"), layers=2)
    return student, make_teacher_dir(tmp_path_factory.mktemp("teacher"), student)


def test_a_teacher_is_required_and_must_share_the_tokenizer(dirs, tmp_path):
    student, teacher = dirs
    with pytest.raises(ValueError, match="^reference.model_path: 'distill' distils from a teacher"):
        engine_for(student, "distill")
    other = tmp_path / "other"
    make_teacher_dir(other, student)
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="^reference.model_path: the teacher's tokenizer"):
        engine_for(student, "distill", reference=ReferenceConfig(model_path=str(other)))


def test_steps_bring_the_students_log_probs_to_the_teachers(dirs):
    student, teacher = dirs
    engine = engine_for(student, "distill", reference=ReferenceConfig(model_path=teacher),
                        optim=OptimConfig(lr=3e-3, minibatches=1))
    batch = make_batch(engine.model, seed=0, version=0)

    def gap() -> float:   # mean |log pi_teacher - log pi_student| over the batch's sampled tokens
        mask = batch.loss_mask.bool()
        return float((engine.reference.logp(batch, 1.0) - frozen_logp(engine.model, batch, 1.0))[mask].abs().mean())

    before = gap()
    for step in range(6):
        metrics = engine.step(batch, step)
    after = gap()
    assert after < 0.6 * before, (before, after)
    assert metrics["kl_ref_k3"] >= 0


def test_the_teachers_top_k_term_is_the_forward_kl_over_its_k_tokens_and_the_rest_and_trains():
    """distill_topk: at each trained position, KL(teacher || student) over the teacher's k likeliest ids and one
    bucket for the rest, with its gradient; zero, and no gradient, where the student is the teacher."""
    from services.trainer.forward import TeacherTopK, logits_token_terms

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, requires_grad=True)
    teacher_logits = torch.randn(5, 11, generator=g)
    top, ids = torch.log_softmax(teacher_logits, -1).topk(3, dim=-1)
    _, _, kl = logits_token_terms(logits, torch.zeros(5, dtype=torch.long), 0.7, False, TeacherTopK(ids, top))
    student = torch.log_softmax(logits / 0.7, -1)
    q = torch.cat([top.exp(), 1 - top.exp().sum(-1, keepdim=True)], -1)   # the coarsened distributions
    s = torch.cat([student.gather(-1, ids).exp(), 1 - student.gather(-1, ids).exp().sum(-1, keepdim=True)], -1)
    torch.testing.assert_close(kl, (q * (q.log() - s.log())).sum(-1))
    assert float(kl.detach().min()) > 0
    kl.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    same = (teacher_logits * 0.7).requires_grad_()   # the student's distribution at 0.7 is the teacher's
    _, _, none = logits_token_terms(same, torch.zeros(5, dtype=torch.long), 0.7, False, TeacherTopK(ids, top))
    none.sum().backward()
    assert float(none.detach().abs().max()) < 1e-5 and float(same.grad.abs().max()) < 1e-5


def test_steps_with_the_teachers_top_k_bring_the_student_to_it(dirs):
    student, teacher = dirs
    engine = engine_for(student, "gkd", reference=ReferenceConfig(model_path=teacher),   # the top-k term alone
                        optim=OptimConfig(lr=1e-2, minibatches=1), algo_overrides={"distill_topk": 8})
    batch = make_batch(engine.model, seed=0, version=0)
    first = engine.step(batch, 0)
    for step in range(1, 10):
        metrics = engine.step(batch, step)
    assert metrics["teacher_topk_kl"] < 0.6 * first["teacher_topk_kl"], (first["teacher_topk_kl"], metrics)


def test_the_teachers_top_k_is_refused_where_it_is_not_built(dirs):
    from services.common.errors import FieldError
    from services.trainer.config import TrainerConfig

    student, _ = dirs
    with pytest.raises(FieldError, match="^reference.model_path: 'gkd' distils from a teacher"):
        TrainerConfig(model_path=student, algo="gkd", wx_address="")
    with pytest.raises(FieldError, match="^algo_overrides.distill_topk: the megatron backend"):
        TrainerConfig(model_path=student, algo="distill", wx_address="", backend="megatron",
                      reference=ReferenceConfig(model_path=student), algo_overrides={"distill_topk": 8})
    with pytest.raises(ValueError, match="distill_topk=-1"):
        AlgorithmConfig.from_preset("distill", distill_topk=-1)
