"""`python -m bench.engine` on the tiny Qwen3 with small sizes: one JSON line per engine, dtype and load with the
documented fields, exactly the asked number of tokens, the weight-update line, and vLLM skipped with a reason when
its venv is not there."""

from __future__ import annotations

import json

from bench import engine as bench_engine


def test_embedded_lines_the_update_line_and_vllm_skipped(tmp_path, capsys, tiny_qwen3):
    bench_engine.main(["--model", str(tiny_qwen3), "--concurrency", "2", "4", "--new-tokens", "5", "--threads", "1",
                       "--vllm-venv", str(tmp_path / "no-venv")])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    gen = [x for x in lines if x["case"] == "generate" and x["engine"] == "embedded"]
    assert [(x["dtype"], x["concurrency"]) for x in gen] == [("float32", 2), ("float32", 4), ("bfloat16", 2),
                                                               ("bfloat16", 4)]
    for x in gen:
        assert x["exact"] and x["tokens"] == 2 * x["concurrency"] * 5
        assert x["tokens_per_second"] > 0 and 0 < x["ttft_p50_seconds"] < x["wall_seconds"]
    updates = [x for x in lines if x["case"] == "weight_update"]
    assert [x["dtype"] for x in updates] == ["float32", "bfloat16"]
    assert all(x["update_seconds"] > 0 and x["reload_seconds"] > 0 and x["restart_seconds"] > 0
               and x["repack_seconds"] >= 0 for x in updates)
    [vllm] = [x for x in lines if x["engine"] == "vllm"]
    assert "no vLLM venv" in vllm["skipped"]
