"""Resumable checkpoints: a restored engine continues bit for bit; incomplete checkpoints are ignored; pruning."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.trainer import checkpoint as ckpt
from services.trainer.lora import LoraConfig
from tests.trainer.test_trainer_engine import engine_for, make_batch, make_model_dir

LINEAGE = {"batch_indices": [0, 1], "batch_ids": ["b0", "b1"], "skipped": []}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def tensors(engine) -> dict[str, torch.Tensor]:
    out = {f"w.{n}": t.detach().clone() for n, t in engine.weights().items()}
    if engine.critic is not None:
        out.update({f"c.{n}": t.detach().clone() for n, t in engine.critic.model.state_dict().items()})
    for i, state in engine.optimizer.state_dict()["state"].items():
        out.update({f"adam.{i}.{k}": v.clone() for k, v in state.items()})
    return out


@pytest.mark.parametrize("algo,kwargs", [("grpo", {}), ("ppo", {}), ("grpo", {"lora": LoraConfig(enabled=True, r=4)})],
                         ids=["grpo", "ppo-critic", "grpo-lora"])
def test_a_restored_engine_takes_the_same_next_step_as_an_uninterrupted_one(algo, kwargs, model_dir, tmp_path):
    torch.manual_seed(0)
    a = engine_for(model_dir, algo, **kwargs)
    batches = [make_batch(a.model, seed=s, version=s) for s in range(3)]
    for v in range(2):
        a.step(batches[v], v)
    path = a.save(tmp_path / "v2", version=2, state={"engine": a.state()}, lineage=LINEAGE)
    rng_before = (torch.get_rng_state(), random.getstate(), a.generator.get_state())
    expected = a.step(batches[2], 2)
    after = tensors(a)

    torch.manual_seed(123)  # a fresh process: other RNG states, initial weights
    random.seed(5)
    b = engine_for(model_dir, algo, **kwargs)
    b.restore(path)
    assert torch.equal(torch.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1]
    assert torch.equal(b.generator.get_state(), rng_before[2])
    assert b.schedule.last_epoch == a.schedule.last_epoch - expected["updates"]
    got = b.step(batches[2], 2)
    assert got == expected
    resumed = tensors(b)
    assert after.keys() == resumed.keys()
    for name, tensor in after.items():
        assert torch.equal(tensor, resumed[name]), name


def test_checkpoint_is_a_plain_hf_model_with_manifest_and_lineage(model_dir, tmp_path):
    engine = engine_for(model_dir, "grpo")
    path = engine.save(tmp_path / "checkpoints" / "v0", version=0, state={"engine": engine.state()}, lineage=LINEAGE)
    manifest = ckpt.read_manifest(path)
    assert manifest["version"] == 0 and {"meshrl_state.pt", "config.json", "model.safetensors"} <= set(manifest["files"])
    assert ckpt.read_lineage(path) == {**LINEAGE, "version": 0}
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in loaded.named_parameters():
        assert torch.equal(tensor, engine.weights()[name]), name
    assert [p.name for p in tmp_path.joinpath("checkpoints").iterdir()] == ["v0"]  # no temporary left behind


def test_incomplete_checkpoints_are_ignored_and_cleaned_and_pruning_keeps_the_newest(model_dir, tmp_path):
    engine = engine_for(model_dir, "grpo")
    root = tmp_path / "checkpoints"
    for v in (2, 4, 6, 8):
        engine.save(root / f"v{v}", version=v, state={"engine": engine.state()}, lineage=LINEAGE)
    engine.save(root / "v10", version=10, lineage=LINEAGE)  # not resumable: no state
    (root / "v8" / ckpt.MANIFEST).unlink()                  # a crash before the manifest: incomplete
    manifest = json.loads((root / "v6" / ckpt.MANIFEST).read_text())
    (root / "v6" / "model.safetensors").write_bytes(b"torn")  # a listed file of the wrong size
    assert ckpt.read_manifest(root / "v6") is None and manifest["files"]["model.safetensors"] > 4
    (root / ".v12.tmp-1-abc").mkdir()                       # an interrupted write
    assert [v for v, _ in ckpt.complete_checkpoints(root)] == [2, 4]
    assert ckpt.latest_checkpoint(root) == root / "v4"
    ckpt.prune_checkpoints(root, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["v4"]
    assert ckpt.latest_checkpoint(tmp_path / "nothing") is None
