"""The engine's bf16 path on any x86-64 CPU. `ONEDNN_MAX_CPU_ISA=AVX2` holds oneDNN (and torch's check of it) to
AVX2 for a whole process, as on a CPU without native bf16 (AMD EPYC before Zen 4, most laptops), so both paths
run on every machine: the forced one always, the native one where the CPU has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from services.common.cpu_features import native_bf16
from services.rollout.engines.runner import PackedLinears, linear_path

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def run_paths(model, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.rollout.cpu_paths_proc", str(model)], capture_output=True,
                          text=True, timeout=240, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_without_native_bf16_the_engine_generates_bf16_on_float32_packed_linears(tiny_qwen3):
    out = run_paths(tiny_qwen3, AVX2_ONLY)
    assert out["cpu_capability"] == "AVX2" and out["native_bf16"] is False
    # the failure the old path hit on every step, so the forcing is real
    assert "bf16 path needs the cpu support" in out["bf16_packing_error"]
    assert out["bfloat16"]["linear_path"] == "packed-float32"
    assert out["float32"]["linear_path"] == "packed"
    for dtype in ("float32", "bfloat16"):
        assert out[dtype]["tokens"] > 0 and "error" not in out[dtype]["finish"] and out[dtype]["failed_steps"] == 0


def test_with_the_machines_own_cpu_bf16_takes_its_native_path(tiny_qwen3):
    out = run_paths(tiny_qwen3, {})
    assert out["native_bf16"] is native_bf16()
    assert out["bfloat16"]["linear_path"] == ("packed" if out["native_bf16"] else "packed-float32")
    assert out["bfloat16"]["tokens"] > 0 and "error" not in out["bfloat16"]["finish"]


def test_linear_path_by_dtype_device_and_prepack():
    cpu = torch.device("cpu")
    assert linear_path(torch.float32, cpu, True) == "packed"
    assert linear_path(torch.bfloat16, cpu, True) == ("packed" if native_bf16() else "packed-float32")
    assert linear_path(torch.bfloat16, cpu, False) == "plain"
    assert linear_path(torch.bfloat16, torch.device("meta"), True) == "plain"


def test_float32_packed_copies_of_bf16_weights_compute_in_float32_and_follow_changes():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8).bfloat16()
    x = torch.randn(3, 16).bfloat16()
    PackedLinears(torch.nn.Sequential(layer), compute=torch.float32)
    expected = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0.02, rtol=0.01)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place through torch: the layer repacks by itself
    torch.testing.assert_close(layer(x).float(), 2 * expected - layer.bias.float(), atol=0.05, rtol=0.02)


@pytest.mark.skipif(not native_bf16(), reason="this CPU has no native bf16: the forced test above covers it")
def test_native_bf16_packs_in_bf16():
    assert linear_path(torch.bfloat16, torch.device("cpu"), True) == "packed"
