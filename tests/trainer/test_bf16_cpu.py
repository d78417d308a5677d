"""`dtype: bfloat16` on a CPU without native bf16 trains in float32 (emulated bf16 autocast is ~18x slower there),
saying so; with native bf16 it runs under bf16 autocast. Both paths on any machine: `ONEDNN_MAX_CPU_ISA=AVX2`
holds a process to AVX2 (tests/rollout/test_engine_cpu_paths.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from services.common.cpu_features import native_bf16
from tests.rollout.test_engine_cpu_paths import AVX2_ONLY

PROBE = """
import json, sys, torch
from services.trainer.backends.torch_backend import TorchBackend
from services.trainer.config import TrainerConfig
backend = TorchBackend(TrainerConfig(model_path=sys.argv[1], dtype="bfloat16", wx_address=""))
with backend.autocast():
    out = backend.model(input_ids=torch.tensor([[5, 6, 7]])).logits
print(json.dumps({"bf16": backend.bf16, "logits": str(out.dtype)}))
"""


def probe(model, env: dict[str, str]) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(model)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout + proc.stderr


def test_without_native_bf16_the_trainer_computes_in_float32_and_says_so(tiny_qwen3):
    out, logs = probe(tiny_qwen3, AVX2_ONLY)
    assert out == {"bf16": False, "logits": "torch.float32"}
    assert "trainer_bf16_emulated" in logs


def test_with_the_machines_own_cpu_the_trainer_autocasts_where_bf16_is_native(tiny_qwen3):
    out, logs = probe(tiny_qwen3, {})
    assert out["bf16"] is native_bf16()
    assert out["logits"] == ("torch.bfloat16" if native_bf16() else "torch.float32")
    assert ("trainer_bf16_emulated" in logs) is not native_bf16()
