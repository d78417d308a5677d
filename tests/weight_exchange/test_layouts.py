"""Layout providers: HF modules (fused experts), incompatible combinations, topology parsing, validation."""

from __future__ import annotations

import pytest
import torch
import transformers

from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.client.layouts.hf import fsdp2_shards, hf_full_shards
from services.weight_exchange.client.layouts.model import ModelSpec, model_spec
from services.weight_exchange.client.layouts.topology import parse_side, side_layouts
from services.weight_exchange.client.sink import pull_all
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.client.transports import cma as cma_mod
from services.weight_exchange.client.transports import shm
from services.weight_exchange.planner import plan
from services.weight_exchange.reference import vllm_local


def tiny_moe_module() -> transformers.Qwen3MoeForCausalLM:
    cfg = transformers.Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg)


def test_hf_module_canonical_names_match_model_spec():
    model = tiny_moe_module()
    shards = hf_full_shards(dict(model.named_parameters()))
    spec = ModelSpec.from_hf_config(model.config.to_dict(), "float32")
    assert {s.canonical_name: s.canonical_shape for s in shards} == spec.canonical()
    assert spec == model_spec("tiny-qwen3-moe")


def test_transformers_fused_experts_to_vllm_tp_over_real_sockets(monkeypatch):
    """A transformers-5 MoE module (fused gate_up_proj / down_proj) sends to vLLM TP 2 ranks, in place."""
    model = tiny_moe_module()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = {}   # checkpoint-namespace tensors, taken from the module through the fused layout
    for s in hf_full_shards(params):
        ref[s.canonical_name] = params[s.local_name][s.local_region.slices()].reshape(s.canonical_shape)
    spec = model_spec("tiny-qwen3-moe")
    server = SenderServer("hf-0", params, transport_names=("tcp", "shm"))
    endpoints = server.start()
    sender = RankLayout("hf-0", SENDER, "hf", hf_full_shards(params), endpoints=endpoints)
    receivers = side_layouts(spec, parse_side("vllm:tp=2"), RECEIVER, "dst")
    p = plan([sender], receivers)
    try:
        for transport, cma in (("tcp", True), ("shm", True), ("shm", False)):
            monkeypatch.setattr(shm, "USE_CMA", cma)
            for r, layout in enumerate(receivers):
                expected = vllm_local(spec, parse_side("vllm:tp=2"), r, ref)
                live = {k: torch.zeros_like(v) for k, v in expected.items()}
                result = pull_all(layout.rank_id, live, p.for_receiver(layout.rank_id), {"hf-0": endpoints[transport]},
                                  transport, 30.0, verify=True)
                assert result.bytes_received == sum(s.num_bytes for s in layout.shards)
                for k in expected:
                    assert torch.equal(live[k], expected[k]), (transport, r, k)
    finally:
        server.stop()


@pytest.mark.parametrize("model,side,message", [
    ("tiny-qwen3", "vllm:tp=3", "num_attention_heads over tp: 4 is not divisible by 3"),
    ("tiny-qwen3", "vllm:tp=8", "num_attention_heads over tp: 4 is not divisible by 8"),
    ("tiny-llama-gqa9", "vllm:tp=6", "9 is not divisible by 6"),
    ("tiny-qwen3-moe", "sglang:tp=4,ep=3", "ep: 3 does not divide tp 4"),
    ("tiny-qwen3-moe", "vllm:tp=4,ep=2", "ep: vLLM's expert parallelism spans every device"),
    ("tiny-qwen3-moe", "megatron:tp=2,ep=2", "ep 2 x etp 2 must divide tp 2 x dp 1"),
    ("tiny-qwen3", "megatron:pp=3", "num_layers over pp: 4 is not divisible by 3"),
    ("tiny-llama-gqa9", "vllm:tp=5", "not divisible by 5"),
])
def test_incompatible_combinations_get_clear_errors(model, side, message):
    with pytest.raises(ValueError, match=message):
        side_layouts(model_spec(model), parse_side(side), RECEIVER, "x")


def test_vocab_padding_must_split_over_tp():
    spec = ModelSpec("llama", vocab_size=300, hidden_size=48, num_layers=1, num_heads=3, num_kv_heads=3, head_dim=16,
                     intermediate_size=48)
    with pytest.raises(ValueError, match=r"vocab \(padded\): 320 is not divisible by 3"):
        side_layouts(spec, parse_side("vllm:tp=3"), RECEIVER, "x")


def test_parse_side_errors():
    with pytest.raises(ValueError, match="src: unknown framework 'deepspeed'"):
        parse_side("deepspeed:tp=2", "src")
    with pytest.raises(ValueError, match="dst: vllm takes tp, ep, dp, edp, .*not 'pp'"):
        parse_side("vllm:pp=2", "dst")
    with pytest.raises(ValueError, match="src: vllm cannot send"):
        side_layouts(model_spec("tiny-qwen3"), parse_side("vllm"), SENDER, "x")


def test_fsdp2_dim0_chunks_match_torch_chunk():
    t = torch.arange(10 * 3).reshape(10, 3).float()
    for dp in (1, 3, 4):
        rows = 0
        for rank, piece in enumerate(t.chunk(dp)):
            shards = fsdp2_shards({"w": piece}, rank, dp, {"w": (10, 3)})
            assert len(shards) == 1 and shards[0].canonical_region.offsets == (rows, 0)
            rows += piece.shape[0]
        assert rows == 10


def test_layout_validation_names_the_field():
    layout = side_layouts(model_spec("tiny-qwen3"), parse_side("vllm:tp=2"), RECEIVER, "x")[0]
    layout.agent_address = "127.0.0.1:1"
    layout.validate()
    layout.shards.append(layout.shards[3])
    with pytest.raises(ValueError, match=r"layout.shards\[\d+\].local_region: .* overlaps"):
        layout.validate()
    layout.agent_address = ""
    with pytest.raises(ValueError, match="layout.agent_address: required"):
        layout.validate()


def test_cma_runs_of_strided_views():
    t = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    view = t[1:5, 2:6]
    runs = cma_mod.runs(*cma_mod.describe(view))
    assert len(runs) == 4 and all(n == 16 for _, n in runs)
    assert runs[0][0] == t.data_ptr() + (1 * 8 + 2) * 4
    assert cma_mod.runs(*cma_mod.describe(t[2:4])) == [(t.data_ptr() + 64, 64)]
