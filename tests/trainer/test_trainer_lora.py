"""LoRA through peft: only adapters train, the sync weights and the checkpoint are the merged model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.trainer.forward import frozen_logp
from services.trainer.lora import LoraConfig
from services.trainer.optim import OptimConfig
from tests.trainer.test_trainer_engine import engine_for, make_batch, make_model_dir

LORA = LoraConfig(enabled=True, r=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def test_lora_trains_only_the_adapters_and_syncs_merged_weights_in_place(model_dir):
    engine = engine_for(model_dir, "grpo", lora=LORA, optim=OptimConfig(lr=1e-2, minibatches=2))
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]) == engine.trainable_parameters()
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    weights = engine.weights()
    assert list(weights) == [n for n, _ in plain.named_parameters()]  # canonical HF names, tied ones once
    before = {n: t.clone() for n, t in weights.items()}
    ids = {n: id(t) for n, t in weights.items()}
    engine.step(make_batch(engine.model), 0)
    assert all(torch.equal(p, frozen[n]) for n, p in engine.model.named_parameters() if not p.requires_grad)
    assert engine.weights() is weights and {n: id(t) for n, t in weights.items()} == ids  # the sender's tensors
    changed = {n for n in weights if not torch.equal(weights[n], before[n])}
    assert changed and all(n.endswith(("proj.weight",)) for n in changed)


def test_merged_export_loads_with_plain_transformers_and_matches_the_peft_model(model_dir, tmp_path):
    engine = engine_for(model_dir, "grpo", lora=LORA, optim=OptimConfig(lr=1e-2))
    batch = make_batch(engine.model)
    for version in range(2):
        engine.step(batch, version)
    out = engine.save(tmp_path / "ckpt", version=2)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "Qwen3ForCausalLM" and not (out / "adapter_config.json").exists()
    expected, got = frozen_logp(engine.model, batch, 1.0), frozen_logp(loaded, batch, 1.0)
    assert (got - expected).abs().max() < 1e-5
    base = frozen_logp(AutoModelForCausalLM.from_pretrained(model_dir), batch, 1.0)
    assert (got - base).abs().max() > 1e-4  # the export carries the trained adapters


@pytest.mark.parametrize("name", ["dpo", "reinforce_pp"])
def test_lora_reference_is_the_policy_with_adapters_off(name, model_dir):
    engine = engine_for(model_dir, name, lora=LORA, optim=OptimConfig(lr=1e-2))
    assert engine.reference is not None and engine.reference.adapters_off
    batch = make_batch(engine.model)
    first, second = engine.step(batch, 0), engine.step(batch, 1)
    assert first["kl_ref_k3"] == pytest.approx(0.0, abs=1e-7) and second["kl_ref_k3"] > 1e-6


def test_lora_config_errors_name_the_field():
    for kwargs, field in (({"r": 0}, "lora.r"), ({"alpha": 0}, "lora.alpha"), ({"dropout": 1.0}, "lora.dropout"),
                          ({"target_modules": []}, "lora.target_modules")):
        with pytest.raises(ValueError, match=field):
            LoraConfig(enabled=True, **kwargs)
    model = AutoModelForCausalLM.from_config(_tiny_config())
    with pytest.raises(ValueError, match="lora.target_modules"):
        LoraConfig(enabled=True, target_modules=["no_such_proj"]).build(model)


def _tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
