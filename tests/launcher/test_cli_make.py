"""The Makefile's targets call `meshrl` (read with `make -n`: nothing runs)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from launcher.stack import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")
MAKE_VARIABLES = ("CONFIG", "NAME", "SEED", "ALGO", "NATS", "KILLS", "SERVICES", "FUZZ_CASES")


def commands(*args: str) -> list[str]:
    """The target's `meshrl` lines (a stale venv adds the setup recipe's lines before them)."""
    # neither this shell's nor an enclosing make's variables (`make test ALGO=…`) may leak into the expansion
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARIABLES + ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [" ".join(line.split()) for line in out.stdout.splitlines() if line.startswith(".venv/bin/meshrl ")]


def test_run_with_a_config_keeps_the_configs_algo():
    assert commands("run", "CONFIG=x.yaml") == [".venv/bin/meshrl run --name x-seed0 --seed 0 --nats single "
                                                "--config x.yaml"]


def test_run_with_a_config_and_an_explicit_algo_name_and_seed():
    assert commands("run", "CONFIG=configs/smollm2.yaml", "ALGO=dapo", "NAME=mine", "SEED=4") == [
        ".venv/bin/meshrl run --name mine --seed 4 --algo dapo --nats single --config configs/smollm2.yaml"]


def test_run_alone_is_the_default_config():
    assert commands("run") == [".venv/bin/meshrl run --name seed0 --seed 0 --nats single"]


@pytest.mark.parametrize(("target", "line"), [
    ("up", "up --seed 0 --nats single"),
    ("down", "down"),
    ("status", "status"),
    ("chaos", "chaos --seed 0 --name chaos-seed0 --nats single"),
    ("run-agent", "run --config configs/agent.yaml --name agent-seed0 --seed 0"),
    ("bench-weights", ["bench weights", "bench weights_live", "bench weights_megatron"]),   # layouts, live paths
    ("bench-gateway", "bench gateway"),
    ("bench-async", "bench async_speedup"),
    ("fuzz", "bench fuzz --cases 10000"),
    ("bench-memory", ["bench memory_peaks", "bench memory_peaks --ranks 2 --megatron tp=2",
                      "bench memory_peaks --ranks 2 --megatron pp=2",
                      "bench memory_peaks --ranks 2 --megatron ep=2 --model artifacts/models/tiny-qwen3-moe-seed0"]),
    ("bench-trainer", "bench trainer_packing"),
    ("bench-routing", "bench routing_replay"),
    ("model-smollm2", "model smollm2"),
])
def test_targets_call_meshrl(target, line):
    lines = line if isinstance(line, list) else [line]
    assert commands(target) == [f".venv/bin/meshrl {one}" for one in lines]
