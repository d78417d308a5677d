"""`device` for the embedded engine: checked when the config is built, resolved when the engine is built; the
runner keeps its tensors on the model's device and hands back plain Python values."""

from __future__ import annotations

import pytest
import torch

from services.common.device import check_device, resolve_device
from services.rollout.engines.runner import ModelRunner
from services.rollout.engines.scheduler import Scheduler
from services.rollout.engines.sequence import Sampling, Sequence
from services.rollout.engines.torch_engine import EngineConfig
from tests.rollout.test_engine import EOS, tiny_model


@pytest.mark.parametrize("name", ["gpu", "cpu:0", "cuda:x", "cuda:", "", "CUDA"])
def test_a_bad_device_names_the_field(name):
    with pytest.raises(ValueError, match="^device: "):
        EngineConfig(device=name)


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:1", "npu", "npu:0"])
def test_known_devices_pass_the_check(name):
    assert check_device(name) == name
    assert EngineConfig(device=name).device == name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_missing_is_a_runtime_error_naming_the_device():
    with pytest.raises(RuntimeError, match="^device: cuda is not available"):
        EngineConfig(device="cuda", model_path="/nonexistent").build()


def test_npu_without_torch_npu_names_the_plugin(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch_npu(name, *args, **kwargs):
        if name == "torch_npu":
            raise ImportError("no torch_npu")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch_npu)
    with pytest.raises(RuntimeError, match="^rollout.device: npu needs torch_npu"):
        resolve_device("npu", "rollout.device")


def test_runner_follows_the_model_device_and_returns_python_values():
    runner = ModelRunner(tiny_model(0), pad_token_id=0, seed=0)
    assert runner.device == torch.device("cpu") and runner.generator.device == torch.device("cpu")
    scheduler = Scheduler(max_batch=2, eos_token_id=EOS, max_context=64)
    for prompt in ([5, 6, 7], [8, 9]):
        scheduler.add(Sequence(prompt_ids=prompt, sampling=Sampling(temperature=1.0, max_new_tokens=3)))
    step = scheduler.schedule()
    tokens, logprobs = runner.run(step)
    assert all(type(t) is int for t in tokens) and all(type(x) is float for x in logprobs)
    assert runner._mask.device == runner._positions.device == runner._last.device == runner.device
