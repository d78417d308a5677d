"""The trainer's step through ``TrainerEngine`` on a tiny Qwen3: every preset, the critic, the reference."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.contracts import data_pb2
from services.trainer.algorithms import PRESETS
from services.trainer.batching import PackedBatch, pack
from services.trainer.config import TrainerConfig
from services.trainer.critic import CriticConfig
from services.trainer.engine import TrainerEngine
from services.trainer.forward import frozen_logp
from services.trainer.models import TinyQwen3Config, build_tokenizer, padded_vocab_size
from services.trainer.optim import OptimConfig
from services.trainer.reference import ReferenceConfig

GROUPS, GROUP, NEW = 4, 4, 4


def make_model_dir(path, *, layers: int = 1, kv_heads: int = 1, experts: int = 0) -> str:
    """`experts` > 0: a Qwen3-MoE with that many top-2 experts a layer."""
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = TinyQwen3Config(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                            num_key_value_heads=kv_heads, head_dim=16, intermediate_size=64,
                            num_experts=experts).build(padded_vocab_size(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def make_batch(model: torch.nn.Module, *, seed: int = 0, version: int = 0) -> PackedBatch:
    """GROUPS prompts x GROUP samples; reward = fraction of completion tokens below 64; group 0 is all 1.0
    (no signal, for dynamic sampling); half the rows were generated one version earlier; the behaviour
    log-probs are the model's own (on-policy)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(GROUPS * GROUP):
        prompt = torch.randint(0, 128, (3,), generator=g).tolist()
        completion = torch.randint(0, 128, (NEW - i % 2,), generator=g).tolist()
        reward = 1.0 if i < GROUP else sum(c < 64 for c in completion) / len(completion)
        trajs.append(data_pb2.Trajectory(
            trajectory_id=f"t{i}", group_id=f"g{i // GROUP}", prompt_ids=prompt, completion_ids=completion,
            behavior_logprobs=[0.0] * len(completion), versions=[max(version - i % 2, 0)] * len(completion),
            loss_mask=[1] * len(completion), reward=reward, finish_reason="length" if i % 2 == 0 else "stop"))
    batch = pack(trajs, 256)
    batch.behav_logp = frozen_logp(model, batch, 1.0) * batch.loss_mask
    return batch


def engine_for(model_dir: str, algo: str, **kwargs) -> TrainerEngine:
    kwargs.setdefault("optim", OptimConfig(lr=3e-3, minibatches=2))
    return TrainerEngine(TrainerConfig(model_path=model_dir, algo=algo, max_new_tokens=NEW, wx_address="", **kwargs))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def make_teacher_dir(path, model_dir: str, *, seed: int = 1) -> str:
    """The model of `model_dir` with other weights (a teacher for distillation), the same tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().clamp(min=0.02))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, model_dir) -> str:
    return make_teacher_dir(tmp_path_factory.mktemp("teacher"), model_dir)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_runs_steps_with_finite_loss(name, model_dir, teacher_dir):
    extra = {"reference": ReferenceConfig(model_path=teacher_dir)} if name in ("distill", "gkd") else {}
    engine = engine_for(model_dir, name, **extra)
    before = {k: v.detach().clone() for k, v in engine.weights().items()}
    for version in range(2):
        metrics = engine.step(make_batch(engine.model, seed=version, version=version), version)
        assert metrics["updates"] >= 1
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert math.isfinite(metrics["loss"]) and metrics["staleness_hist_0"] + metrics.get("staleness_hist_1", 0) \
            == GROUPS * GROUP
    assert any(not torch.equal(before[k], v) for k, v in engine.weights().items()), "the policy did not move"
    assert (engine.critic is not None) == (name == "ppo")
    assert (engine.reference is not None) == (name in ("reinforce_pp", "dpo", "distill", "gkd"))
    if name == "dapo":
        assert metrics["groups_dropped"] == 1 and metrics["samples_kept"] == (GROUPS - 1) * GROUP
    if name == "dpo":
        assert metrics["dpo_pairs"] == GROUPS - 1 and metrics["groups_tied"] == 1
    if name == "sft":
        assert metrics["samples_kept"] == int((make_batch(engine.model, seed=1).rewards > 0).sum())


def test_online_step_reports_the_documented_metrics(model_dir):
    engine = engine_for(model_dir, "ppo", reference=ReferenceConfig(always=True))
    metrics = engine.step(make_batch(engine.model, version=1), 1)
    for key in ("clip_fraction", "approx_kl", "importance_weight_mean", "importance_weight_max",
                "behav_imp_weight_mean", "behav_imp_weight_max", "masked_fraction", "entropy", "staleness_hist_0",
                "staleness_hist_1", "value_loss", "kl_ref", "kl_ref_k3", "groups_total", "groups_dropped",
                "grad_norm", "value_grad_norm"):
        assert key in metrics, key
    assert metrics["staleness_hist_0"] == metrics["staleness_hist_1"] == GROUPS * GROUP / 2


def test_critic_value_loss_falls_on_a_fixed_batch(model_dir):
    engine = engine_for(model_dir, "ppo", critic=CriticConfig(optim=OptimConfig(lr=1e-2)))
    batch = make_batch(engine.model)
    losses = [engine.step(batch, 0)["value_loss"] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_reference_kl_is_zero_at_start_and_positive_after_updates(model_dir):
    engine = engine_for(model_dir, "reinforce_pp", optim=OptimConfig(lr=1e-2, minibatches=2))
    batch = make_batch(engine.model)
    first = engine.step(batch, 0)
    second = engine.step(batch, 1)
    assert first["kl_ref_k3"] == pytest.approx(0.0, abs=1e-7)
    assert second["kl_ref_k3"] > 1e-5 and "kl_reward_mean" in second
    assert not any(p.requires_grad for p in engine.reference.model.parameters())
