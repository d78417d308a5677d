"""`python -m bench.engine` on the tiny Qwen3 with small sizes: one JSON line per engine, dtype and load with the
documented fields, exactly the asked number of tokens, the weight-update line, and vLLM skipped with a reason when
its venv is not there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import engine as bench_engine
from services.common.cpu_features import native_bf16
from tests.rollout.test_engine_cpu_paths import AVX2_ONLY


def test_embedded_lines_the_update_line_and_vllm_skipped(tmp_path, capsys, tiny_qwen3):
    bench_engine.main(["--model", str(tiny_qwen3), "--concurrency", "2", "4", "--new-tokens", "5", "--threads", "1",
                       "--prefix-tokens", "64", "--vllm-venv", str(tmp_path / "no-venv")])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    gen = [x for x in lines if x["case"] == "generate" and x["engine"] == "embedded"]
    assert [(x["dtype"], x["concurrency"]) for x in gen] == [("float32", 2), ("float32", 4), ("bfloat16", 2),
                                                               ("bfloat16", 4)]
    bf16_path = "packed" if native_bf16() else "packed-float32"
    assert [x["linear_path"] for x in gen] == ["packed", "packed", bf16_path, bf16_path]
    for x in gen:
        assert x["exact"] and x["tokens"] == 2 * x["concurrency"] * 5
        assert x["tokens_per_second"] > 0 and 0 < x["ttft_p50_seconds"] < x["wall_seconds"]
    updates = [x for x in lines if x["case"] == "weight_update"]
    assert [x["dtype"] for x in updates] == ["float32", "bfloat16"]
    assert all(x["update_seconds"] > 0 and x["reload_seconds"] > 0 and x["restart_seconds"] > 0
               and x["repack_seconds"] >= 0 for x in updates)
    prefix = [x for x in lines if x["case"] == "prefix_cache"]
    assert [x["dtype"] for x in prefix] == ["float32", "bfloat16"]
    for x in prefix:   # each warm request reused the whole 64-token prefix; the cold ones found nothing
        assert x["prefix_tokens"] == 64 and x["hit_tokens"] == x["repeats"] * 64
        assert x["cold_seconds"] > 0 and x["warm_seconds"] > 0 and x["warm_over_cold"] > 0
    [vllm] = [x for x in lines if x["engine"] == "vllm"]
    assert "no vLLM venv" in vllm["skipped"]


def test_on_a_cpu_without_native_bf16_the_bf16_lines_name_the_float32_path(tmp_path, tiny_qwen3):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--model", str(tiny_qwen3), "--concurrency", "2", "--new-tokens", "4",
         "--threads", "1", "--dtypes", "bfloat16", "--no-update", "--engines", "embedded"],
        capture_output=True, text=True, timeout=300, env={**os.environ, **AVX2_ONLY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    [gen] = [x for x in lines if x["case"] == "generate" and x["engine"] == "embedded"]
    assert gen["linear_path"] == "packed-float32" and gen["exact"] and gen["tokens"] == 2 * 2 * 4
