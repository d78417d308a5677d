"""The benchmark's simulation and CLI on small configs (the measured cases run in `make bench-weights`)."""

from __future__ import annotations

import json
import subprocess
import sys

from services.weight_exchange.bench.simulate import simulate
from tests.weight_exchange.harness import ROOT


def test_simulate_small_moe():
    line = simulate("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=2,etp=1,dp=2", "vllm:tp=4,dp=2", link_gbps=10)
    assert line["bytes_moved"] == line["bytes_min"] > line["model_bytes"]
    assert line["senders"] == 8 and line["receivers"] == 8
    assert line["speedup_vs_naive"] > line["speedup_vs_bcast"] > 1


def test_cli_simulate_and_errors():
    cmd = [sys.executable, "-m", "services.weight_exchange.bench", "--simulate", "--model", "tiny-qwen3",
           "--src", "megatron:tp=2", "--dst", "sglang:tp=2,dp=2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["case"] == "simulate"
    bad = subprocess.run(cmd[:-1] + ["vllm:tp=3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "num_attention_heads over tp: 4 is not divisible by 3" in bad.stderr
