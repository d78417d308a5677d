"""The pre-flight memory planner: its pure formulas (sharding, Megatron per-rank counts from the layouts, bad
input) and its prediction against the measured peak of real CPU training steps (bench/memory_peaks.py)."""

from __future__ import annotations

import json

import pytest

from bench.memory_peaks import Case, build_model, can_measure, compare_all
from services.trainer.plan import PlanConfig, main, parse_bytes, plan
from services.trainer.planning import params as counts
from services.trainer.planning.model import planned_model
from services.weight_exchange.client.layouts.model import BUILTIN
from services.weight_exchange.client.layouts.topology import parse_side, side_layouts
from tests.marks import full

QWEN3_8B = {**BUILTIN["qwen3-8b"], "architectures": ["Qwen3ForCausalLM"]}
MOE = {**BUILTIN["tiny-qwen3-moe"], "num_experts_per_tok": 2}


def model(config=QWEN3_8B):
    return planned_model(config)


def test_torch_holds_every_parameter_with_float32_grads_and_two_adam_moments():
    m = model()
    rank = plan(m, PlanConfig(micro_batch_tokens=128)).ranks[0]
    n = m.spec.num_params()
    assert (rank.parameters, rank.gradients, rank.optimizer) == (4 * n, 4 * n, 8 * n)
    assert rank.total == rank.parameters + rank.gradients + rank.optimizer + rank.activations + rank.weight_sync


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_fsdp2_divides_parameters_gradients_and_optimizer_by_dp(dp):
    m = model()
    ranks = plan(m, PlanConfig(backend="fsdp2", dp=dp, micro_batch_tokens=128)).ranks
    assert len(ranks) == dp
    assert sum(r.parameters for r in ranks) == 4 * m.spec.num_params()
    for r in ranks:
        assert r.parameters == pytest.approx(4 * m.spec.num_params() / dp, rel=1e-3)
        assert r.gradients == r.parameters and r.optimizer == 2 * r.parameters
        assert r.detail["activations.gathered_parameters"] > 0   # one layer (and the root) unsharded at a time
    assert ranks[0].weight_sync == 4 * m.spec.num_params() and ranks[1].weight_sync == 0


@pytest.mark.parametrize("config,backend", [
    (QWEN3_8B, "megatron:tp=4"), (QWEN3_8B, "megatron:tp=2,pp=2"), (MOE, "megatron:tp=2,ep=2"),
    (MOE, "megatron:pp=2,ep=2"), ({**BUILTIN["tiny-llama-gqa9"], "architectures": ["LlamaForCausalLM"]},
                                  "megatron:tp=3")])
def test_megatron_per_rank_counts_are_the_layouts_local_shapes_summed(config, backend):
    m = model(config)
    dp = 2
    result = plan(m, PlanConfig(backend=backend, dp=dp, micro_batch_tokens=64, dtype="bfloat16"))
    side = parse_side(backend)
    layouts = side_layouts(m.spec, type(side)("megatron", {**side.sizes, "dp": dp}), "sender", "r")
    assert len(result.ranks) == len(layouts)
    for rank, layout in zip(result.ranks, layouts, strict=True):
        local = {s.local_name: s.local_shape for s in layout.shards}
        expected = sum(counts.numel(shape) for shape in local.values())
        assert rank.parameters == 4 * expected      # float32 parameters (bf16 compute by autocast)
        assert rank.gradients == 4 * expected       # float32 gradients
        assert rank.optimizer == 8 * expected       # AdamW's two moments
        assert rank.detail["activations.autocast_weights"] == 2 * expected
    # rank 0's gathered copy of the whole model is host memory on an accelerator
    assert result.ranks[0].weight_sync == 0 and result.ranks[0].detail["host_staging"] >= 4 * m.spec.num_params()
    on_cpu = plan(m, PlanConfig(backend=backend, dp=dp, micro_batch_tokens=64, device="cpu"))
    assert on_cpu.ranks[0].weight_sync == 4 * counts.full_parameters(m.spec).numel
    assert all(r.weight_sync == 0 for r in on_cpu.ranks[1:])


def test_megatron_tp_divides_the_layers_and_pp_the_stages():
    m = model()
    one = plan(m, PlanConfig(backend="megatron:tp=1", micro_batch_tokens=64)).ranks[0].parameters
    tp4 = plan(m, PlanConfig(backend="megatron:tp=4", micro_batch_tokens=64)).ranks
    assert all(r.parameters == tp4[0].parameters for r in tp4)
    assert tp4[0].parameters == pytest.approx(one / 4, rel=0.01)   # the vocabulary pads to 128 * tp
    pp = plan(m, PlanConfig(backend="megatron:pp=2", micro_batch_tokens=64)).ranks
    assert pp[0].detail["activations.head"] == 0 < pp[1].detail["activations.head"]


def test_lora_trains_only_the_adapters_and_syncs_merged_copies():
    m = model()
    rank = plan(m, PlanConfig(micro_batch_tokens=128, lora_rank=16)).ranks[0]
    adapters, adapted = counts.lora_numel(m.spec, 16)
    assert rank.gradients == 4 * adapters and rank.optimizer == 8 * adapters
    assert rank.weight_sync == 4 * adapted


def test_activations_grow_with_tokens_and_the_head_with_the_vocabulary():
    m = model()
    small = plan(m, PlanConfig(micro_batch_tokens=1024)).ranks[0]
    big = plan(m, PlanConfig(micro_batch_tokens=4096)).ranks[0]
    for part in ("layers", "head"):
        assert big.detail[f"activations.{part}"] == 4 * small.detail[f"activations.{part}"]
    assert big.activations == sum(v for k, v in big.detail.items() if k.startswith("activations."))
    assert small.detail["activations.head"] == 1024 * m.spec.vocab_size * 20


def test_the_verdict_compares_the_peak_rank_with_the_device_memory():
    m = model()
    result = plan(m, PlanConfig(backend="megatron:tp=4", micro_batch_tokens=2048, dtype="bfloat16",
                                device_memory=parse_bytes("80GiB")))
    assert result.fits and result.margin == 80 * 2**30 - result.peak.total
    assert not plan(m, PlanConfig(micro_batch_tokens=4096, device_memory=parse_bytes("80GiB"))).fits


@pytest.mark.parametrize("field,value", [("hidden_size", None), ("hidden_size", 0), ("vocab_size", "big"),
                                         ("num_attention_heads", -1), ("num_key_value_heads", 5),
                                         ("intermediate_size", 0), ("model_type", "gpt2")])
def test_a_bad_config_field_is_named(field, value):
    config = dict(QWEN3_8B)
    if value is None:
        del config[field]
    else:
        config[field] = value
    if field == "model_type":
        config["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match=field if field != "model_type" else "model_type"):
        planned_model(config)


def test_a_moe_config_needs_its_top_k():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        planned_model(BUILTIN["tiny-qwen3-moe"])


@pytest.mark.parametrize("kwargs,field", [
    ({"backend": "deepspeed"}, "backend"), ({"backend": "torch", "dp": 2}, "dp"),
    ({"backend": "megatron:tp=0"}, "backend"), ({"backend": "megatron:zz=2"}, "backend"),
    ({"micro_batch_tokens": 0}, "micro_batch_tokens"), ({"dtype": "float16"}, "dtype"),
    ({"optimizer": "sgd"}, "optimizer"), ({"backend": "fsdp2", "lora_rank": 8}, "lora_rank"),
    ({"seq_len": 9999}, "seq_len"), ({"device": "tpu"}, "device")])
def test_bad_plan_settings_are_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PlanConfig(**{"micro_batch_tokens": 128, **kwargs})


def test_megatron_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_attention_heads over tp"):
        plan(model(), PlanConfig(backend="megatron:tp=3", micro_batch_tokens=64))


@pytest.mark.parametrize("text,value", [("80GiB", 80 << 30), ("141GB", 141 * 10**9), ("512MiB", 512 << 20),
                                        ("1000", 1000)])
def test_device_memory_sizes(text, value):
    assert parse_bytes(text) == value
    with pytest.raises(ValueError, match="device_memory"):
        parse_bytes("lots")


def test_the_command_line_prints_the_verdict_and_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    args = ["--model", str(tmp_path), "--backend", "megatron:tp=4", "--dp", "2", "--micro-batch-tokens", "2048",
            "--dtype", "bfloat16", "--device-memory", "80GiB"]
    assert main(args) == 0
    assert "FITS" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and len(out["ranks"]) == 8
    assert main(["--model", str(tmp_path), "--micro-batch-tokens", "4096", "--device-memory", "24GiB"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["--model", str(tmp_path / "nowhere"), "--micro-batch-tokens", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not can_measure(), reason="needs Linux's /proc/self/clear_refs to reset the peak resident set")
@pytest.mark.parametrize("backends", ["torch,fsdp2", full("megatron")])
def test_predicted_peaks_are_within_25_percent_of_measured_cpu_steps(tmp_path, backends):
    """A 1.3M-parameter Qwen3 whose 4096-token vocabulary makes the head matter: the torch backend at two
    micro-batch sizes, fsdp2 over 2 gloo ranks (each forwards half the rows; rank 0 also holds full weights for
    the sender), and (make test-full) the megatron backend's ranks at tp=2 and pp=2 (megatron-core's schedule;
    rank 0 gathers the whole model after each step). Each measuring process runs alone; cases overlap."""
    model_dir = build_model(tmp_path / "qwen3", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                            intermediate=384, vocab=4096)
    if backends == "megatron":
        cases = [Case(model_dir, 4, 256, ranks=2, megatron="tp=2"), Case(model_dir, 8, 256, ranks=2, megatron="pp=2")]
        expected = [("megatron:tp=2", 0), ("megatron:tp=2", 1), ("megatron:pp=2", 0), ("megatron:pp=2", 1)]
    else:
        cases = [Case(model_dir, 1, 256), Case(model_dir, 4, 256), Case(model_dir, 4, 256, ranks=2)]
        expected = [("torch", 0), ("torch", 0), ("fsdp2", 0), ("fsdp2", 1)]
    results = compare_all(cases, parallel=3)
    assert [(r["backend"], r["rank"]) for r in results] == expected
    for result in results:
        assert abs(result["error"]) <= 0.25, result
