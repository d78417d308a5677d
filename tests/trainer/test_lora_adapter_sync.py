"""lora.sync: adapter: the weight sync moves only the LoRA adapters from the trainer into the embedded engine,
which merges them into its base weights; the engine then holds what a merged-weights sync would have given it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.errors import FieldError
from services.rollout.engines.lora_merge import AdapterConfig
from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig
from services.trainer.lora import LoraConfig
from services.trainer.optim import OptimConfig
from services.weight_exchange.bench.local import engine_receiver, local_exchange
from tests.trainer.test_trainer_engine import engine_for, make_batch, make_model_dir

LORA = LoraConfig(enabled=True, r=4, alpha=8.0, sync="adapter")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny"), layers=2)


async def test_only_the_adapters_travel_and_the_engine_merges_them(model_dir):
    trainer = engine_for(model_dir, "grpo", lora=LORA, optim=OptimConfig(lr=1e-2, minibatches=2))
    sent = trainer.weights()
    assert sent and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in sent)
    adapter_bytes = sum(t.numel() * 4 for t in sent.values())
    model_bytes = sum(p.numel() * 4 for p in trainer.merged.tensors.values())
    engine = EngineConfig(model_path=model_dir, lora=AdapterConfig(r=4, alpha=8.0), max_context=128).build()
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.start()
    try:
        async with local_exchange(sent, engine_receiver(engine), delta=True, full_every=100) as wx:
            for version in (1, 2, 3):
                trainer.step(make_batch(trainer.model, seed=version), version - 1)
                reply = await wx.update(version)
                # the adapters' bytes (Adam moves every adapter element: a delta of them is the whole of them)
                assert reply.bytes_moved == reply.bytes_full == adapter_bytes < model_bytes / 5
                merged = trainer.merged.refresh()
                live = dict(engine.model.named_parameters())
                for name, tensor in merged.items():
                    torch.testing.assert_close(live[name], tensor, rtol=0, atol=1e-6, msg=name)
        changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, base[n])}
        assert changed and all(n.endswith("proj.weight") for n in changed)   # the adapted linears only
        seq = (await asyncio.wait_for(engine.generate([5, 6, 7], Sampling(temperature=0.0, max_new_tokens=4)), 60))[0]
        assert seq.versions == [3] * len(seq.versions)
    finally:
        engine.stop()


def test_adapter_settings_are_checked_naming_the_field(model_dir):
    with pytest.raises(FieldError, match="lora.sync"):
        LoraConfig(enabled=True, sync="deltas")
    with pytest.raises(FieldError, match="engine.lora.r"):
        AdapterConfig(r=-1)
    with pytest.raises(FieldError, match="engine.lora.target_modules: no linear layer"):
        EngineConfig(model_path=model_dir, lora=AdapterConfig(r=4, target_modules=["nothing"])).build()
