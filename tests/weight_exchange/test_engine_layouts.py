"""Layouts that match the real engines (issue 12, item 3): vLLM's expert-parallel rule, in-engine data parallelism,
uneven / round-robin expert placement, refused EPLB and SGLang DP attention, Megatron's uneven pipeline stages,
vocab padding options, o_proj bias, vLLM-Ascend's transposed experts, post-load-transformed receivers, layouts
from live parameters, device tensors in the receive path. Bytes move over real sockets (in process)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch
import transformers

from services.weight_exchange.client.agents import ReceiverAgent
from services.weight_exchange.client.layout import POST_LOAD_TRANSFORMED, RECEIVER, SENDER, RankLayout
from services.weight_exchange.client.layouts.inference import InferenceParallel, expert_ids, inference_shards
from services.weight_exchange.client.layouts.live import LayoutMismatch, live_layout, receiver_views
from services.weight_exchange.client.layouts.megatron import pipeline_stages, stage_layers
from services.weight_exchange.client.layouts.model import ModelSpec, model_spec
from services.weight_exchange.client.layouts.topology import (
    megatron_parallel,
    parse_side,
    rank_shards,
    side_layouts,
)
from services.weight_exchange.client.sink import pull_all
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.client.wire import byte_view
from services.weight_exchange.planner import bytes_min, plan
from services.weight_exchange.reference import hf_reference, local_tensors

MOE = model_spec("tiny-qwen3-moe")
W13 = "model.layers.0.mlp.experts.w13_weight"


def held_experts(side_text: str, rank: int, spec: ModelSpec = MOE) -> list[int]:
    shards, _ = rank_shards(spec, parse_side(side_text), rank)
    return sorted({int(s.canonical_name.split(".")[5]) for s in shards
                   if s.local_name == W13 and ".experts." in s.canonical_name})


def exchange(spec: ModelSpec, src: str, dst: str, transports=("tcp",), dtype=torch.float32, live_device=None):
    """Every rank of `src` serves the HF reference sharded by its own rule; every rank of `dst` pulls into zeroed
    tensors (receiver_views of them); returns [(expected, live)] per receiver rank (live: the real tensors)."""
    ref = hf_reference(spec, 3, dtype)
    src_side, dst_side = parse_side(src), parse_side(dst)
    servers, senders = [], []
    for r, layout in enumerate(side_layouts(spec, src_side, SENDER, "src", str(dtype).removeprefix("torch."))):
        server = SenderServer(layout.rank_id, local_tensors(spec, src_side, r, ref), transport_names=transports)
        layout.endpoints = server.start()
        servers.append(server)
        senders.append(layout)
    receivers = side_layouts(spec, dst_side, RECEIVER, "dst", str(dtype).removeprefix("torch."))
    p = plan(senders, receivers, bucket_bytes=8 << 10)
    out = []
    try:
        for transport in transports:
            out = []
            for r, layout in enumerate(receivers):
                expected = local_tensors(spec, dst_side, r, ref)
                live = {k: torch.zeros_like(v, device=live_device) for k, v in expected.items()}
                views = receiver_views(dst_side.framework, live)
                result = pull_all(layout.rank_id, views, p.for_receiver(layout.rank_id),
                                  {s.rank_id: s.endpoints[transport] for s in senders}, transport, 60.0,
                                  verify=live_device is None)
                assert result.bytes_received == sum(s.num_bytes for s in layout.shards)
                out.append((expected, live))
    finally:
        for server in servers:
            server.stop()
    assert p.stats.total_bytes == bytes_min(receivers)
    return out


def assert_equal(pairs) -> None:
    for r, (expected, live) in enumerate(pairs):
        for k in expected:
            assert torch.equal(live[k], expected[k]), (r, k)


# --- vLLM expert parallelism: all-or-nothing over tp x edp -------------------------------------------------------

def test_vllm_refuses_ep_inside_tp_which_is_sglangs_layout():
    with pytest.raises(ValueError, match=r"ep: vLLM's expert parallelism spans every device .*ep=2 inside tp=4 is "
                                         r"SGLang's layout"):
        side_layouts(MOE, parse_side("vllm:tp=4,ep=2"), RECEIVER, "x")
    side_layouts(MOE, parse_side("sglang:tp=4,ep=2"), RECEIVER, "x")   # SGLang's own layout stays


def test_vllm_in_engine_dp_shards_experts_over_dp_times_tp():
    # no EP: the experts are TP-sharded over all 4 devices of the engine (2I / 4 rows), attention over tp=2
    layouts = side_layouts(MOE, parse_side("vllm:tp=2,edp=2"), RECEIVER, "x")
    assert len(layouts) == 4
    assert {layout.local_tensors()[W13][0] for layout in layouts} == {(8, 2 * 32 // 4, 64)}
    assert layouts[0].local_tensors()["model.layers.0.self_attn.qkv_proj.weight"][0][0] == (4 + 2 * 1) * 16   # 8 q / 2 kv heads over tp=2
    # EP: ep = tp x edp = 4, whole experts, rank k = edp_rank * tp + tp_rank holds experts 2k, 2k + 1
    assert [held_experts("vllm:tp=2,edp=2,ep=4", r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # meshrl dp (independent replicas) repeats the engine; edp does not
    assert [held_experts("vllm:tp=2,edp=2,ep=4,dp=2", r) for r in (4, 7)] == [[0, 1], [6, 7]]
    with pytest.raises(ValueError, match="ep: .*ep = tp x edp = 2 x 2 = 4"):
        side_layouts(MOE, parse_side("vllm:tp=2,edp=2,ep=2"), RECEIVER, "x")
    with pytest.raises(ValueError, match="ep: .*ep = tp x edp = 1 x 1 = 1"):
        side_layouts(MOE, parse_side("vllm:ep=2"), RECEIVER, "x")


def test_vllm_uneven_and_round_robin_expert_placement():
    assert [held_experts("vllm:edp=3,ep=3", r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [held_experts("vllm:edp=3,ep=3,rr=1", r) for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert expert_ids(10, 4, 1) == (3, 4, 5) and expert_ids(10, 4, 3) == (8, 9)
    with pytest.raises(ValueError, match="expert_placement: applies only with expert parallelism"):
        inference_shards(MOE, InferenceParallel(tp=2, expert_placement="round_robin"))


@pytest.mark.parametrize("dst", ["vllm:edp=3,ep=3", "vllm:edp=3,ep=3,rr=1", "vllm:tp=2,edp=2", "sglang:tp=4,ep=2"])
def test_expert_layouts_bit_exact_against_the_engines_loading_rule(dst):
    assert_equal(exchange(MOE, "megatron:tp=2,ep=2,dp=2,etp=1", dst))


def test_eplb_and_sglang_dp_attention_are_refused_clearly():
    with pytest.raises(ValueError, match="dst: eplb: vLLM's EPLB .* not supported"):
        parse_side("vllm:tp=2,eplb=1", "dst")
    with pytest.raises(ValueError, match="eplb: vLLM's EPLB .*redundant_experts"):
        inference_shards(MOE, InferenceParallel(tp=2, ep=2, redundant_experts=2))
    with pytest.raises(ValueError, match="eplb: SGLang's EPLB .* not supported"):
        inference_shards(MOE, InferenceParallel(tp=4, ep=2, engine="sglang", redundant_experts=2))
    with pytest.raises(ValueError, match="dst: dpa: SGLang's DP attention .* not supported"):
        parse_side("sglang:tp=4,dpa=2", "dst")
    with pytest.raises(ValueError, match="dp_attention: SGLang's DP attention"):
        inference_shards(MOE, InferenceParallel(tp=4, engine="sglang", dp_attention=2))


# --- Megatron uneven pipeline stages --------------------------------------------------------------------------

def test_megatron_uneven_stages_follow_megatrons_rule():
    assert megatron_parallel(parse_side("megatron:pp=4,first=6"), 0, 36).layers_per_stage == (6, 10, 10, 10)
    assert megatron_parallel(parse_side("megatron:pp=4,last=6"), 0, 36).layers_per_stage == (10, 10, 10, 6)
    assert megatron_parallel(parse_side("megatron:pp=4,first=6,last=6"), 0, 36).layers_per_stage == (6, 12, 12, 6)
    assert pipeline_stages(94, 8, 11, 11) == (11, 12, 12, 12, 12, 12, 12, 11)
    assert pipeline_stages(10, 2, first=4) == (4, 6)
    with pytest.raises(ValueError, match="leave 31 layers that do not divide evenly over the 3 other stages"):
        megatron_parallel(parse_side("megatron:pp=4,first=5"), 0, 36)
    with pytest.raises(ValueError, match="do not divide evenly"):
        pipeline_stages(36, 2, 6, 6)
    spec = dataclasses.replace(model_spec("tiny-qwen3"), num_layers=36)
    par = megatron_parallel(parse_side("megatron:pp=4,first=6"), 3, 36)
    assert stage_layers(spec, par) == range(26, 36)


def test_megatron_first_only_stages_bit_exact():
    spec = dataclasses.replace(model_spec("tiny-qwen3"), num_layers=7)
    assert_equal(exchange(spec, "megatron:pp=3,first=1", "vllm:tp=2"))


# --- vocabulary padding ---------------------------------------------------------------------------------------

def vocab_rows(side_text: str, rank: int, spec: ModelSpec) -> tuple[int, int, int]:
    """(canonical start row, rows, local rows) of the embedding on a rank."""
    shards, _ = rank_shards(spec, parse_side(side_text), rank)
    s = next(s for s in shards if s.canonical_name == "model.embed_tokens.weight")
    return s.canonical_region.offsets[0], s.canonical_region.sizes[0], s.local_shape[0]


def test_vocab_padding_options_on_both_sides():
    spec = model_spec("tiny-qwen3")    # vocab 264
    assert vocab_rows("megatron:tp=2", 1, spec) == (256, 8, 256)                  # 128 x tp = 256 -> 512
    assert vocab_rows("megatron:tp=2,vocab_div=64", 1, spec) == (192, 72, 192)    # 64 x 2 -> 384
    assert vocab_rows("megatron:tp=2,unpadded=1", 1, spec) == (132, 132, 132)     # Megatron-Bridge: unpadded
    assert vocab_rows("vllm:tp=2", 1, spec) == (160, 104, 160)                    # vLLM: 64 -> 320
    assert vocab_rows("vllm:tp=2,vocab_pad=1", 1, spec) == (132, 132, 132)        # unpadded
    assert vocab_rows("sglang:tp=4,vocab_pad=1", 3, spec) == (198, 66, 66)
    with pytest.raises(ValueError, match=r"vocab \(padded\): 264 is not divisible by 5"):
        side_layouts(dataclasses.replace(spec, num_heads=5, num_kv_heads=5, head_dim=16), parse_side(
            "megatron:tp=5,unpadded=1"), SENDER, "x")


def test_unpadded_vocab_bit_exact():
    assert_equal(exchange(model_spec("tiny-qwen3"), "megatron:tp=2,unpadded=1", "vllm:tp=2,vocab_pad=1"))
    assert_equal(exchange(model_spec("tiny-qwen3"), "megatron:tp=2,vocab_div=64", "sglang:tp=4,vocab_pad=1"))


# --- biases ---------------------------------------------------------------------------------------------------

def test_every_bias_the_model_has_is_carried():
    llama = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    qwen2 = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)
    qwen3 = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True)
    for config, cls in ((llama, transformers.LlamaForCausalLM), (qwen2, transformers.Qwen2ForCausalLM),
                        (qwen3, transformers.Qwen3ForCausalLM)):
        model = cls(config)
        spec = ModelSpec.from_hf_config(config.to_dict(), "float32")
        real = {k: tuple(v.shape) for k, v in model.named_parameters()}
        real.setdefault("lm_head.weight", real["model.embed_tokens.weight"])
        assert {k: v for k, v in spec.canonical().items()} == {k: v for k, v in real.items()
                                                               if k in spec.canonical() or "lm_head" not in k}, cls
        assert spec.o_bias == (cls is not transformers.Qwen2ForCausalLM)
    spec = ModelSpec.from_hf_config(llama.to_dict(), "float32")
    shards, _ = rank_shards(spec, parse_side("vllm:tp=2"), 1)
    bias = [s for s in shards if s.canonical_name.endswith("o_proj.bias")]
    assert [(s.local_name, s.local_shape) for s in bias] == [("model.layers.0.self_attn.o_proj.bias", (64,))]
    shards, _ = rank_shards(spec, parse_side("megatron:tp=2"), 1)
    assert any(s.local_name == "decoder.layers.0.self_attention.linear_proj.bias" for s in shards)
    assert_equal(exchange(spec, "megatron:tp=2", "vllm:tp=2"))


# --- vLLM-Ascend: experts transposed after loading ------------------------------------------------------------

@pytest.mark.parametrize("dst", ["vllm_ascend:tp=2", "vllm_ascend:tp=2,ep=2"])
def test_vllm_ascend_transposed_experts_land_in_place(dst):
    pairs = exchange(MOE, "hf", dst, transports=("tcp", "shm"))
    assert_equal(pairs)
    expected, live = pairs[1]
    ep = "ep=2" in dst
    assert tuple(live[W13].shape) == ((4, 64, 64) if ep else (8, 64, 32))          # [E, H, 2I/moe_tp]
    assert tuple(live["model.layers.0.mlp.experts.w2_weight"].shape) == ((4, 32, 64) if ep else (8, 16, 64))


# --- post-load-transformed receivers: never raw bytes, the engine's load_weights ------------------------------

def test_post_load_transformed_receiver_gets_checkpoint_tensors_for_load_weights(caplog):
    spec = model_spec("tiny-qwen3")
    ref = hf_reference(spec, 5, torch.float32)
    senders = side_layouts(spec, parse_side("megatron:tp=2"), SENDER, "src")
    receivers = side_layouts(spec, parse_side("vllm:tp=2"), RECEIVER, "dst")
    receivers[1].parallel[POST_LOAD_TRANSFORMED] = 1
    assert receivers[1].post_load_transformed and not receivers[0].post_load_transformed
    with caplog.at_level(logging.WARNING):
        p = plan(senders, receivers)
    assert p.load_weights == ["dst-1"]
    assert "dst-1 declares a post-load-transformed layout" in caplog.text
    live_names = set(receivers[1].local_tensors())
    mine = p.for_receiver("dst-1")
    assert mine and not {t.dst_local for t in mine} & (live_names - set(spec.canonical()))
    assert {t.dst_local for t in mine} == set(spec.canonical())   # every tensor it holds part of, whole
    assert {t.dst_local for t in p.for_receiver("dst-0")} <= live_names   # the other one is written in place
    # move the bytes: staging tensors equal the checkpoint tensors
    servers = []
    try:
        for r, layout in enumerate(senders):
            server = SenderServer(layout.rank_id, local_tensors(spec, parse_side("megatron:tp=2"), r, ref))
            layout.endpoints = server.start()
            servers.append(server)
        staging = {n: torch.zeros(shape) for n, shape in spec.canonical().items()}
        pull_all("dst-1", staging, mine, {s.rank_id: s.endpoints["tcp"] for s in senders}, "tcp", 30.0, verify=True)
    finally:
        for server in servers:
            server.stop()
    assert all(torch.equal(staging[n], ref[n]) for n in staging)


def test_receiver_agent_with_load_weights_registers_transformed_and_refuses_live_writes():
    spec = model_spec("tiny-qwen3")
    layout = side_layouts(spec, parse_side("vllm:tp=2"), RECEIVER, "dst")[0]
    params = {k: torch.zeros(shape) for k, (shape, _) in layout.local_tensors().items()}
    agent = ReceiverAgent("dst-0", params, "127.0.0.1:1", shards=layout.shards, framework="vllm",
                          parallel=layout.parallel, load_weights=lambda weights: None)
    assert agent.layout().post_load_transformed
    p = plan(side_layouts(spec, parse_side("hf"), SENDER, "src"), [dataclasses.replace(
        agent.layout(), agent_address="127.0.0.1:2")])
    targets = agent._targets(p.transfers)
    assert set(targets) == set(spec.canonical()) and all(t.data_ptr() not in {v.data_ptr() for v in params.values()}
                                                         for t in targets.values())
    raw = dataclasses.replace(p.transfers[0], dst_local="model.layers.0.self_attn.qkv_proj.weight")
    with pytest.raises(ValueError, match="post-load-transformed layout: only staging tensors are written"):
        agent._targets([raw])
    assert RankLayout.from_proto(agent.layout().to_proto()).post_load_transformed


# --- layouts from the live engine ----------------------------------------------------------------------------

def live_params(spec: ModelSpec, side_text: str, rank: int) -> dict[str, torch.Tensor]:
    return local_tensors(spec, parse_side(side_text), rank, hf_reference(spec, 0, torch.bfloat16))


def test_live_layout_matches_the_formula_and_names_every_difference():
    params = live_params(MOE, "vllm:tp=2", 1)
    layout = live_layout("r-1", params, MOE, "vllm", tp=2, tp_rank=1)
    formula, _ = rank_shards(MOE, parse_side("vllm:tp=2"), 1, "bfloat16")
    assert layout.shards == formula and layout.parallel["tp_rank"] == 1
    assert live_layout("r-1", dict(params).items(), MOE, tp=2, tp_rank=1).shards == formula   # an iterator too
    bad = dict(params)
    del bad["model.norm.weight"]
    bad["model.rotary.inv_freq"] = torch.zeros(8)
    bad["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 16)
    with pytest.raises(LayoutMismatch, match=r"missing \['model.norm.weight'\]; extra \['model.rotary.inv_freq'\]; "
                                             r"shape differs: model.layers.1.self_attn.o_proj.weight: live \[64, 16\], "
                                             r"expected \[64, 64\]"):
        live_layout("r-1", bad, MOE, "vllm", tp=2, tp_rank=1)
    with pytest.raises(LayoutMismatch, match="shape differs: model.layers.0.mlp.experts.w13_weight"):
        live_layout("r-1", params, MOE, "vllm", tp=2, tp_rank=1, ep=2)     # it holds TP-sharded, not EP, experts


def test_live_layout_takes_vllm_experts_held_in_their_routed_experts_child():
    """vLLM 0.3x: `mlp.experts.routed_experts.w13_weight`; the shards keep the live names."""
    params = live_params(MOE, "vllm:tp=2", 0)
    nested = {k.replace(".experts.", ".experts.routed_experts."): v for k, v in params.items()}
    layout = live_layout("r", nested, MOE, "vllm", tp=2, tp_rank=0)
    formula, _ = rank_shards(MOE, parse_side("vllm:tp=2"), 0, "bfloat16")
    assert [s.local_name for s in layout.shards] == [s.local_name.replace(".experts.", ".experts.routed_experts.")
                                                     for s in formula]
    assert any(".routed_experts." in s.local_name for s in layout.shards)
    assert [dataclasses.replace(s, local_name="") for s in layout.shards] == \
        [dataclasses.replace(s, local_name="") for s in formula]


def test_live_layout_from_a_vllm_expert_map_and_layer_range():
    params = live_params(MOE, "vllm:edp=3,ep=3,rr=1", 2)            # experts 2, 5
    expert_map = torch.full((8,), -1, dtype=torch.int32)
    expert_map[2], expert_map[5] = 0, 1
    layout = live_layout("r", params, MOE, "vllm", edp=3, edp_rank=2, ep=3, expert_map=expert_map)
    assert layout.shards == rank_shards(MOE, parse_side("vllm:edp=3,ep=3,rr=1"), 2, "bfloat16")[0]
    expert_map[2], expert_map[6] = -1, 0                             # a map that is not what the rank holds
    with pytest.raises(LayoutMismatch):
        live_layout("r", {k: v for k, v in params.items()}, MOE, "vllm", edp=3, edp_rank=2, ep=3,
                    expert_ids=[6, 5, 1])
    # a pipeline stage holding layer 1 only: no embedding, norm and lm_head present, global layer names
    stage = {k: v for k, v in params.items() if not k.startswith(("model.layers.0.", "model.embed_tokens"))}
    layout = live_layout("r", stage, MOE, "vllm", edp=3, edp_rank=2, ep=3, layers=(1, 2), expert_ids=[2, 5])
    assert {s.local_name for s in layout.shards} == set(stage) and layout.parallel["layer_start"] == 1


def test_live_layout_of_vllm_ascend_takes_the_transposed_shapes():
    params = live_params(MOE, "vllm_ascend:tp=2,ep=2", 0)
    assert tuple(params[W13].shape) == (4, 64, 64) and tuple(params["model.layers.0.mlp.experts.w2_weight"].shape) \
        == (4, 32, 64)
    layout = live_layout("r", params, MOE, "vllm_ascend", tp=2, tp_rank=0, ep=2)
    views = receiver_views("vllm_ascend", params)
    assert tuple(views["model.layers.0.mlp.experts.w2_weight"].shape) == (4, 64, 32)
    assert views[W13].data_ptr() == params[W13].data_ptr()
    assert {s.local_name: s.local_shape for s in layout.shards}[W13] == tuple(views[W13].shape)
    with pytest.raises(LayoutMismatch, match=r"w2_weight: live \[4, 32, 64\], expected \[4, 64, 32\]"):
        live_layout("r", params, MOE, "vllm", tp=2, tp_rank=0, ep=2)       # plain vLLM has them untransposed


# --- device tensors in the receive path: never .numpy() --------------------------------------------------------

def test_bf16_pulls_and_device_tensors_never_reach_numpy():
    assert_equal(exchange(model_spec("tiny-qwen3"), "megatron:tp=2", "vllm:tp=2", transports=("tcp", "shm"),
                          dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        torch.zeros(2, dtype=torch.bfloat16).numpy()        # what `.numpy()` on a bf16 tensor does
    with pytest.raises(TypeError, match="byte_view: a meta tensor has no host bytes"):
        byte_view(torch.zeros(4, device="meta"))
    # live tensors that are not CPU memory (meta stands in for a GPU here): the transports stage on the host and
    # copy_ into them, they never take their bytes
    transports = ("tcp", "shm") + (("ucx",) if importlib.util.find_spec("ucxx") else ())
    exchange(model_spec("tiny-qwen3"), "megatron:tp=2", "vllm:tp=2", transports=transports, dtype=torch.bfloat16,
             live_device="meta")


async def test_receiver_agent_applies_through_load_weights_and_leaves_live_tensors_alone():
    from services.common.contracts import weight_exchange_pb2 as wx_pb2

    spec = model_spec("tiny-qwen3")
    ref = hf_reference(spec, 7, torch.float32)
    layout = side_layouts(spec, parse_side("vllm:tp=2"), RECEIVER, "dst")[1]
    params = {k: torch.zeros(shape) for k, (shape, _) in layout.local_tensors().items()}
    loaded: list[tuple[str, torch.Tensor]] = []
    agent = ReceiverAgent("dst-1", params, "127.0.0.1:1", shards=layout.shards, framework="vllm",
                          parallel=layout.parallel, load_weights=loaded.extend)
    server = SenderServer("src-0", ref)
    try:
        endpoints = server.start()
        src = RankLayout("src-0", SENDER, "hf", side_layouts(spec, parse_side("hf"), SENDER, "s")[0].shards,
                         endpoints=endpoints)
        p = plan([src], [dataclasses.replace(agent.layout(), agent_address="127.0.0.1:2")], bucket_bytes=4096)
        assert p.load_weights == ["dst-1"]
        request = wx_pb2.ApplyRequest(version=1, transport="tcp", timeout_seconds=30.0, verify=True,
                                      sender_endpoints={"src-0": endpoints["tcp"]},
                                      transfers=[t.to_proto() for t in p.transfers])
        result = await agent._apply(request, p.transfers)
    finally:
        server.stop()
    assert agent.version == 1 and result.bytes_received == bytes_min([agent.layout()])
    held = {s.canonical_name for s in layout.shards}
    assert [name for name, _ in loaded] == sorted(held)
    assert all(torch.equal(t, ref[name]) for name, t in loaded)
    assert all(not t.any() for t in params.values())      # no raw byte reached a live tensor
