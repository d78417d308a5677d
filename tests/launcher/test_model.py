"""A run config's `model` (a built-in name or a Hugging Face model directory) and `dtype`, and what each
service's config gets from them."""

from __future__ import annotations

import pathlib

import pytest

from launcher.runconfig import RunConfig
from launcher.stack import Stack, random_ports, resolve_model


def model_dir(root: pathlib.Path, *files: str) -> pathlib.Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in files:
        (root / name).write_text("{}")
    return root


def test_a_model_directory_resolves_to_its_absolute_path(tmp_path, monkeypatch):
    path = model_dir(tmp_path / "m", "config.json", "model.safetensors", "tokenizer.json")
    assert resolve_model(str(path), seed=0) == path.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("m", seed=0) == path.resolve()   # relative to the working directory


def test_sharded_weights_and_a_tokenizer_config_are_enough(tmp_path):
    path = model_dir(tmp_path / "m", "config.json", "model.safetensors.index.json", "tokenizer_config.json")
    assert resolve_model(str(path), seed=0) == path.resolve()


@pytest.mark.parametrize(("files", "missing"), [
    (("model.safetensors", "tokenizer.json"), "config.json"),
    (("config.json", "tokenizer.json"), "safetensors"),
    (("config.json", "model.safetensors"), "tokenizer"),
])
def test_a_directory_missing_a_file_is_refused_naming_model(tmp_path, files, missing):
    path = model_dir(tmp_path / "m", *files)
    with pytest.raises(ValueError, match=rf"^model: .*no .*{missing}"):
        resolve_model(str(path), seed=0)


@pytest.mark.parametrize("model", ["no-such-model", "/nonexistent/dir", "", None, 3])
def test_neither_a_name_nor_a_directory_is_refused_naming_model(model):
    with pytest.raises(ValueError, match="^model: "):
        resolve_model(model, seed=0)


def test_dtype_defaults_to_float32_and_refuses_others():
    assert RunConfig.from_dict({}).dtype == "float32"
    assert RunConfig.from_dict({"dtype": "bfloat16"}).dtype == "bfloat16"
    with pytest.raises(ValueError, match="^dtype: must be one of float32, bfloat16, got 'float16'"):
        RunConfig.from_dict({"dtype": "float16"})


def test_every_service_that_loads_the_model_gets_the_same_path_and_the_dtype(tmp_path):
    stack = Stack(tmp_path / "run", random_ports(), secure=False)
    plan = {"dtype": "bfloat16", "services": {"builder": {"total_steps": 2}, "trainer": {}}}
    model = tmp_path / "hf-model"
    cfg = stack.derive(RunConfig.from_dict(plan), seed=3, model_path=model).configs
    assert cfg["rollout"].engine.model_path == str(model)
    assert {cfg[s].model_path for s in ("builder", "reward", "trainer")} == {str(model)}
    assert cfg["rollout"].engine.dtype == cfg["trainer"].dtype == "bfloat16"
    # a service's own setting wins over the run's
    plan["services"]["rollout"] = {"engine": {"dtype": "float32"}}
    assert stack.derive(RunConfig.from_dict(plan), seed=3, model_path=model).configs["rollout"].engine.dtype == \
        "float32"


def test_the_engine_and_trainer_configs_refuse_an_unknown_dtype():
    from services.rollout.engines.torch_engine import EngineConfig
    from services.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="^engine.dtype: "):
        EngineConfig(dtype="float16")
    with pytest.raises(ValueError, match="^dtype: "):
        TrainerConfig(dtype="half")


def test_bfloat16_engine_loads_bf16_weights_and_the_trainer_steps_under_autocast(tiny_qwen3):
    """Under bf16 autocast where the CPU has native bf16; in float32 elsewhere (tests/trainer/test_bf16_cpu.py
    forces the other path on every machine)."""
    import torch

    from services.common.cpu_features import native_bf16
    from services.rollout.engines.torch_engine import EngineConfig
    from services.trainer.config import TrainerConfig
    from services.trainer.engine import TrainerEngine

    engine = EngineConfig(model_path=str(tiny_qwen3), dtype="bfloat16").build()
    assert {p.dtype for p in engine.named_parameters().values()} == {torch.bfloat16}
    trainer = TrainerEngine(TrainerConfig(model_path=str(tiny_qwen3), dtype="bfloat16", wx_address=""))
    assert {p.dtype for p in trainer.weights().values()} == {torch.float32}   # master weights stay float32
    with trainer.autocast():
        logits = trainer.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == (torch.bfloat16 if native_bf16() else torch.float32)


def test_a_config_and_its_dataset_files_are_read_from_the_working_directory(tmp_path, monkeypatch):
    from launcher.stack import ROOT

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "run.yaml").write_text("model: m\ndataset: {train: data/train.jsonl, eval: elsewhere.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    plan = RunConfig.load("run.yaml", root=ROOT)
    assert plan.dataset["train"] == str(tmp_path / "data" / "train.jsonl")
    assert plan.dataset["eval"] == "elsewhere.jsonl"   # not here: left to the builder (the repository)
    assert RunConfig.load("configs/e2e.yaml", root=ROOT).model == "tiny-qwen3"   # else from the repository
    with pytest.raises(ValueError, match="^config: no such file"):
        RunConfig.load("missing.yaml", root=ROOT)
