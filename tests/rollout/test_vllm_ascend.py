"""engine.kind vllm_ascend on a CPU host: its configuration, that torch_npu is imported only when an NPU engine
starts (a missing library is an error naming engine.device), and the layout it hands to the weight exchange. No
vLLM-Ascend server runs here (that needs Ascend NPUs)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_the_device_must_be_an_npu(tiny_qwen3):
    from services.rollout.config import RolloutEngineConfig

    for device in ("cpu", "cuda:0"):
        with pytest.raises(ValueError, match="engine.device"):
            RolloutEngineConfig(kind="vllm_ascend", model_path=str(tiny_qwen3), device=device)
    with pytest.raises(ValueError, match="device: expected"):   # the engine section's own check, first
        RolloutEngineConfig(kind="vllm_ascend", device="npu:x")


def test_building_imports_no_torch_npu_and_starting_names_the_field(tiny_qwen3):
    # in a fresh interpreter: nothing else may have imported torch_npu before
    code = f"""
import sys
from services.rollout.config import RolloutEngineConfig
from services.rollout.engines.vllm_engine import VLLMConfig
engine = RolloutEngineConfig(kind="vllm_ascend", model_path={str(tiny_qwen3)!r}, device="npu:1", max_context=256,
                             vllm=VLLMConfig(url="http://127.0.0.1:1", weight_updates=False)).build()
assert "torch_npu" not in sys.modules, "torch_npu imported by config or build"
assert (engine.kind, engine.collective_backend, engine.layout_engine, engine.device) == \\
    ("vllm_ascend", "hccl", "vllm_ascend", "npu:1")
try:
    engine.start()
except RuntimeError as exc:
    print("ERROR", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if importlib.util.find_spec("torch_npu") is None:
        assert "ERROR engine.device: npu:1 needs torch_npu" in out.stdout, out.stdout + out.stderr[-1000:]


def test_the_engine_satisfies_the_protocol_and_keeps_vllm_checks(tiny_qwen3):
    from services.rollout.engines.base import Engine
    from services.rollout.engines.vllm_ascend_engine import VLLMAscendEngine, build_vllm_ascend
    from services.rollout.engines.vllm_engine import VLLMConfig

    config = VLLMConfig(url="http://127.0.0.1:1", weight_updates=False)
    engine = build_vllm_ascend(config, device="npu", model_path=str(tiny_qwen3), max_batch=4, max_context=256)
    assert isinstance(engine, VLLMAscendEngine) and isinstance(engine, Engine) and engine.kind == "vllm_ascend"
    with pytest.raises(ValueError, match="engine.dtype"):
        build_vllm_ascend(config, device="npu", model_path=str(tiny_qwen3), max_batch=4, max_context=256,
                          dtype="int4")


def test_the_receiver_layout_takes_the_transposed_experts():
    import torch

    from services.rollout.engines.vllm_ascend_engine import receiver_layout
    from services.weight_exchange.client.layouts.live import LayoutMismatch
    from services.weight_exchange.client.layouts.model import model_spec
    from services.weight_exchange.client.layouts.topology import parse_side
    from services.weight_exchange.reference import hf_reference, local_tensors

    spec = model_spec("tiny-qwen3-moe")
    params = local_tensors(spec, parse_side("vllm_ascend:tp=2,ep=2"), 0, hf_reference(spec, 0, torch.bfloat16))
    w13, w2 = "model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"
    layout, tensors = receiver_layout("rollout-0-0", params, spec, tp=2, tp_rank=0, ep=2)
    assert layout.framework == "vllm_ascend"
    shards = {s.local_name: s.local_shape for s in layout.shards}
    for name in (w13, w2):   # written through views of the live (transposed) storage, in the layout's shapes
        assert tensors[name].data_ptr() == params[name].data_ptr()
        assert tuple(tensors[name].shape) == tuple(params[name].shape[:-2]) + tuple(params[name].shape[-2:][::-1])
        assert shards[name] == tuple(tensors[name].shape)
    dense = "model.layers.0.self_attn.qkv_proj.weight"
    assert tensors[dense] is params[dense]
    params[w2] = params[w2].transpose(-2, -1).contiguous()   # untransposed, as plain vLLM holds it
    with pytest.raises(LayoutMismatch, match="w2_weight"):
        receiver_layout("rollout-0-0", params, spec, tp=2, tp_rank=0, ep=2)
