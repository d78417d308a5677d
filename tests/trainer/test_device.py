"""`device` for the trainer: checked with the config, resolved when the engine is built; batches move to the
device, checkpoints are written from host copies (tied tensors stay tied)."""

from __future__ import annotations

import pytest
import torch

from services.common.device import host_copy
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainerEngine
from tests.trainer.test_trainer_engine import make_batch, make_model_dir


@pytest.mark.parametrize("name", ["gpu", "cuda:-1", "cpu:1"])
def test_a_bad_device_names_the_field(name):
    with pytest.raises(ValueError, match="^device: "):
        TrainerConfig(device=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_missing_is_a_runtime_error_naming_the_device(tmp_path):
    with pytest.raises(RuntimeError, match="^device: cuda:0 is not available"):
        TrainerEngine(TrainerConfig(model_path=make_model_dir(tmp_path), device="cuda:0", wx_address=""))


def test_host_copy_keeps_cpu_tensors_and_structure():
    a = torch.arange(6.0)
    state = {"x": a, "nested": [a, (1, "s")], "n": 3}
    out = host_copy(state)
    assert out["x"] is a and out["nested"][0] is a and out["nested"][1] == (1, "s") and out["n"] == 3


def test_host_copy_keeps_shared_storage_shared():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device to copy from")
    w = torch.randn(4, 4, device="cuda")
    out = host_copy({"embed": w, "lm_head": w, "other": w.clone()})
    assert out["embed"] is out["lm_head"] and out["other"] is not out["embed"] and out["embed"].device.type == "cpu"


def test_the_engine_on_cpu_moves_batches_and_trains(tmp_path):
    engine = TrainerEngine(TrainerConfig(model_path=make_model_dir(tmp_path), device="cpu", wx_address=""))
    assert engine.device == torch.device("cpu")
    batch = make_batch(engine.model)
    moved = batch.to(engine.device)
    assert moved.input_ids is batch.input_ids  # on the host already: the same tensors, no copy
    metrics = engine.step(batch, version=0)
    assert all(v == v for v in metrics.values())


def test_the_launcher_passes_the_run_device_to_the_engine_and_the_trainer(tmp_path):
    from launcher.runconfig import RunConfig
    from launcher.stack import Stack, random_ports

    stack = Stack(tmp_path / "run", random_ports(), secure=False)

    def configs(plan: dict) -> dict:
        return stack.derive(RunConfig.from_dict(plan), seed=0, model_path=tmp_path).configs

    plan = {"device": "cuda:1", "services": {"builder": {"total_steps": 2}, "trainer": {}}}
    assert configs(plan)["rollout"].engine.device == "cuda:1"
    assert configs(plan)["trainer"].device == "cuda:1"
    plan["services"]["trainer"] = {"device": "cpu"}  # a service's own setting wins over the run's
    assert configs(plan)["trainer"].device == "cpu"
    assert configs({})["trainer"].device == "cpu" and configs({})["rollout"].engine.device == "cpu"  # the default
    with pytest.raises(ValueError, match="^device: "):
        RunConfig.from_dict({"device": "gpu"})
