"""Typed config: defaults, YAML, MESHRL_<SERVICE>__<KEY> overrides, errors naming the key."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from services.builder.config import BuilderConfig
from services.common.config import ConfigError, ServiceConfig, load_config
from services.trainer.config import TrainerConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(kw_only=True)
class Inner:
    rate: float = 0.5
    names: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class Demo(ServiceConfig):
    steps: int = 3
    enabled: bool = False
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_defaults_yaml_then_env(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text("steps: 7\ninner: {rate: 0.25, names: [a, b]}\n")
    env = {"MESHRL_DEMO__ENABLED": "true", "MESHRL_DEMO__INNER__RATE": "0.125", "OTHER": "x"}
    cfg = load_config(Demo, "demo", path=path, env=env)
    assert (cfg.steps, cfg.enabled, cfg.inner.rate, cfg.inner.names) == (7, True, 0.125, ["a", "b"])
    assert load_config(Demo, "demo", env={}).steps == 3


@pytest.mark.parametrize("env,needle", [
    ({"MESHRL_DEMO__STEPZ": "1"}, "demo.stepz: unknown key"),
    ({"MESHRL_DEMO__STEPS": "many"}, "demo.steps: expected an integer"),
    ({"MESHRL_DEMO__ENABLED": "maybe"}, "demo.enabled: expected true/false"),
    ({"MESHRL_DEMO__INNER__RATE": "fast"}, "demo.inner.rate: expected a number"),
    ({"MESHRL_DEMO__INNER__NOPE": "1"}, "demo.inner.nope: unknown key"),
])
def test_unknown_or_ill_typed_keys_are_named(env, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(Demo, "demo", env=env)


def test_service_validation_names_the_field():
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(BuilderConfig, "builder", env={"MESHRL_BUILDER__MAX_STALENESS": "-1"})
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(TrainerConfig, "trainer", env={"MESHRL_TRAINER__OPTIM__LR": "0"})


def test_a_service_refuses_to_start_on_a_bad_key():
    proc = subprocess.run([sys.executable, "-m", "services.builder"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MESHRL_BUILDER__BATCH_SIZ": "3"}, cwd=ROOT)
    assert proc.returncode == 2
    assert "builder.batch_siz: unknown key" in proc.stderr


def test_a_service_runs_on_the_cpus_its_environment_names():
    cpus = sorted(os.sched_getaffinity(0))
    code = "import os; from services.common.service import pin_cpus; pin_cpus('reward'); print(sorted(os.sched_getaffinity(0)))"
    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "MESHRL_CPUS_REWARD": str(cpus[-1])})
    assert run.stdout.strip() == f"[{cpus[-1]}]", run.stderr
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "MESHRL_CPUS_REWARD": "one"})
    assert "MESHRL_CPUS_REWARD: comma-separated CPU numbers, got 'one'" in run.stderr
