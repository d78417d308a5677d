"""The megatron backend with real megatron-core ranks (gloo on CPU) takes the steps the single-process torch
backend takes on the same batches, at tp=2 (tensor parallel), at tp=1 x dp=2, on a tiny Qwen3-MoE at ep=2
(expert parallel: each rank holds half the experts, the MoE layers gather both ranks' tokens) and at tp=2 x ep=2
with whole experts (etp=1: attention split over both ranks, each rank two whole experts), and at pp=2 with
uneven stages (megatron-core's 1F1B schedule, 1 + 2 of 3 layers, the tied embedding on both stages), alone and on
four ranks with tensor parallelism (tp=2 x pp=2) or expert parallelism (ep=2 x pp=2) inside the stages: the same
losses, gradient norms and final weights, and a checkpoint resumed inside the group retakes its step exactly."""

from __future__ import annotations

import json

import pytest
import torch

from services.trainer.config import MegatronConfig, TrainerConfig
from services.trainer.optim import OptimConfig
from services.trainer.packing import PackingConfig
from tests.marks import full
from tests.ranks import join_cpu_group, leave_cpu_group, run_spawned
from tests.trainer.test_fsdp2 import train_checkpoint_retake
from tests.trainer.test_trainer_engine import NEW, engine_for, make_batch, make_model_dir

pytest.importorskip("megatron.core")

STEPS, RANKS, DEADLINE = 2, 2, 300.0
OPTIM = OptimConfig(lr=3e-3, minibatches=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """Two key-value heads, so that two tensor-parallel ranks hold one each."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-tp"), layers=2, kv_heads=2)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory) -> str:
    """Three layers: two pipeline stages split them unevenly."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-pp"), layers=3, kv_heads=2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE: 4 experts a layer, top-2, two ep ranks holding two each."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-moe"), layers=2, kv_heads=2, experts=4)


def config(model_dir: str, sizes: dict[str, int], run_dir: str, ranks: int = RANKS) -> TrainerConfig:
    return TrainerConfig(model_path=model_dir, algo="grpo", max_new_tokens=NEW, wx_address="", optim=OPTIM,
                         backend="megatron", ranks=ranks, megatron=MegatronConfig(**sizes), run_dir=run_dir)


def rank_main(rank: int, world: int, store: str, model_dir: str, sizes: dict[str, int], batches_file: str,
              out_file: str) -> None:
    """One rank: train STEPS batches, checkpoint before the last, resume from it and retake it."""
    from services.trainer.engine import build_engine

    torch.set_num_threads(1)
    join_cpu_group(rank, world, store)
    engine = build_engine(config(model_dir, sizes, f"{out_file}.run", world))
    out = train_checkpoint_retake(engine, torch.load(batches_file, weights_only=False), rank, f"{out_file}.ckpt")
    torch.save({**out, "trainable": engine.trainable_parameters()}, f"{out_file}.{rank}")
    leave_cpu_group()


def close(a: float, b: float, rel: float = 1e-4, abs_: float = 1e-6) -> bool:
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_)


# make test: tensor parallel, and tensor x expert parallel (pipeline stages: the uneven-stage checkpoint test
# below); the other layouts in make test-full
@pytest.mark.parametrize("sizes, model, world", [
    ({"tp": 2}, "model_dir", 2), full({"tp": 1}, "model_dir", 2), full({"ep": 2}, "moe_dir", 2),
    ({"tp": 2, "ep": 2, "etp": 1}, "moe_dir", 2),
    full({"pp": 2, "num_layers_in_first_pipeline_stage": 1}, "deep_dir", 2),
    # four ranks on two cores: pipeline stages combined with tensor and with expert parallelism
    full({"tp": 2, "pp": 2, "num_layers_in_first_pipeline_stage": 1}, "deep_dir", 4),
    full({"ep": 2, "pp": 2}, "moe_dir", 4)],
    ids=["tp=2", "tp=1,dp=2", "moe:ep=2,dp=2", "moe:tp=2,ep=2,etp=1", "pp=2:first=1,last=2",
         "tp=2,pp=2:first=1", "moe:ep=2,pp=2,dp=2"])
def test_megatron_ranks_take_the_single_process_steps(request, tmp_path, sizes, model, world):
    model_dir = request.getfixturevalue(model)
    moe = model == "moe_dir"
    torch.manual_seed(0)
    single = engine_for(model_dir, "grpo", optim=OPTIM)
    batches = [make_batch(single.model, seed=s, version=s) for s in range(STEPS)]
    torch.save(batches, tmp_path / "batches.pt")
    initial = {name: t.detach().clone() for name, t in single.weights().items()}
    expected = [single.step(b, v) for v, b in enumerate(batches)]
    out = str(tmp_path / "out")
    codes = run_spawned(rank_main, [(r, world, str(tmp_path / "store"), model_dir, sizes, str(tmp_path / "batches.pt"),
                                     out) for r in range(world)], deadline_s=DEADLINE)
    assert codes == [0] * world, f"rank exit codes {codes} (negative: killed at the {DEADLINE}s deadline)"
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]

    got = ranks[0]["metrics"]
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for key in ("loss", "grad_norm", "entropy", "approx_kl", "advantage_abs_mean"):
            assert close(want[key], have[key]), f"step {step} {key}: torch {want[key]} vs megatron {have[key]}"
    for other in ranks[1:]:
        assert [m["loss"] for m in other["metrics"]] == [m["loss"] for m in got]
        assert other["weights"] == {}  # only rank 0 gathers full weights
    assert ranks[0]["trainable"] == single.trainable_parameters()  # rank 0 reports the whole model's
    weights = single.weights()
    assert set(ranks[0]["weights"]) == set(weights)
    moved = 0.0
    for name, tensor in weights.items():
        # ~1e-6 apart (reductions in another order; Adam's first steps magnify that where a gradient is ~0)
        torch.testing.assert_close(ranks[0]["weights"][name], tensor.detach(), rtol=1e-4, atol=5e-5, msg=name)
        moved = max(moved, float((ranks[0]["weights"][name] - initial[name]).abs().max()))
    assert moved > 1e-3  # the steps changed the weights: the comparison is not of two untrained models
    architecture = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    assert json.loads((tmp_path / "out.ckpt" / "config.json").read_text())["architectures"] == [architecture]
    assert ranks[0]["again_metrics"]["loss"] == got[-1]["loss"]
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(ranks[0]["again_weights"][name], tensor), name


def reshard_rank(rank: int, store: str, model_dir: str, sizes: dict[str, int], batches_file: str, out_file: str,
                 resume: bool) -> None:
    """Write (``resume`` False): one step, a checkpoint, the next step. Resume: restore that checkpoint into this
    layout and take the next step again."""
    import torch.distributed as dist

    from services.trainer.engine import build_engine

    torch.set_num_threads(1)
    join_cpu_group(rank, RANKS, store)
    engine = build_engine(config(model_dir, sizes, f"{out_file}.run"))
    first, second = torch.load(batches_file, weights_only=False)
    if resume:
        engine.restore(f"{out_file}.ckpt")
    else:
        engine.step(first, 0)
        state = {"engine": engine.state()}
        if rank == 0:
            engine.save(f"{out_file}.ckpt", version=1, state=state)
        dist.barrier()
    metrics = engine.step(second, 1)
    engine.gather_weights()
    weights = {name: t.detach().clone() for name, t in engine.weights().items()}
    torch.save({"metrics": metrics, "weights": weights}, f"{out_file}.{'resumed' if resume else 'written'}.{rank}")
    leave_cpu_group()


def test_a_checkpoint_written_at_tp2_resumes_on_two_uneven_pipeline_stages(deep_dir, tmp_path):
    """megatron-core's distributed checkpoint: the tp=2 ranks each write their column shards; the pp=2 ranks
    (1 + 2 layers) each load whole layers of them, and AdamW's moments with them — the step after the checkpoint
    comes out the same on either layout."""
    torch.manual_seed(0)
    single = engine_for(deep_dir, "grpo", optim=OPTIM)
    torch.save([make_batch(single.model, seed=s, version=s) for s in range(2)], tmp_path / "batches.pt")
    out = str(tmp_path / "out")
    for sizes, resume in (({"tp": 2}, False), ({"pp": 2, "num_layers_in_first_pipeline_stage": 1}, True)):
        codes = run_spawned(reshard_rank, [(r, str(tmp_path / f"store{resume}"), deep_dir, sizes,
                                            str(tmp_path / "batches.pt"), out, resume) for r in range(RANKS)],
                            deadline_s=DEADLINE)
        assert codes == [0] * RANKS, f"{sizes}: rank exit codes {codes}"
    assert (tmp_path / "out.ckpt" / "dist").is_dir()
    assert not list((tmp_path / "out.run" / "checkpoints").glob(".dist.tmp-*"))  # the staging moved in
    written = torch.load(f"{out}.written.0", weights_only=False)
    resumed = torch.load(f"{out}.resumed.0", weights_only=False)
    for key in ("loss", "grad_norm", "entropy", "approx_kl"):
        assert close(written["metrics"][key], resumed["metrics"][key]), key
    # AdamW's moments came along too: from zero moments its second update would move each weight by ~lr (3e-3),
    # far outside this tolerance
    for name, tensor in written["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], tensor, rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.parametrize("settings, field", [
    ({"ranks": 3, "megatron": MegatronConfig(tp=2)}, "^ranks: 3 ranks do not split"),
    ({"algo": "ppo"}, "^backend: megatron .* 'ppo'"),
    ({"packing": PackingConfig(enabled=True)}, "^packing.enabled: "),
    ({"ranks": 2, "megatron": MegatronConfig(tp=2, ep=2)}, "^megatron.ep: 2 ranks .* ep 2 x expert tp 2 .*etp"),
    ({"ranks": 2, "megatron": MegatronConfig(ep=2, etp=2)}, "^megatron.ep: 2 ranks .* ep 2 x expert tp 2"),
])
def test_what_the_megatron_backend_cannot_run_is_refused_at_start_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=field):
        TrainerConfig(backend="megatron", **{"ranks": 2, **settings})


@pytest.mark.parametrize("sizes, field", [
    ({"num_layers_in_last_pipeline_stage": 2}, "^num_layers_in_last_pipeline_stage: needs pp > 1"),
    ({"pp": 2, "num_layers_in_first_pipeline_stage": 0}, "^num_layers_in_first_pipeline_stage: needs pp > 1 and a"),
    ({"microbatches": -1}, "^microbatches: must be >= 0"), ({"tp": 0}, "^tp: must be >= 1"),
    ({"etp": -1}, "^etp: must be >= 1"),
    ({"moe_aux_loss_coeff": -1.0}, "^moe_aux_loss_coeff: must be >= 0")])
def test_bad_parallel_settings_are_refused_naming_them(sizes, field):
    with pytest.raises(ValueError, match=field):
        MegatronConfig(**sizes)


def test_uneven_stages_the_layouts_define_reach_megatron_core_and_a_bad_split_is_refused():
    from services.trainer.megatron.model import transformer_config
    from services.weight_exchange.client.layouts.megatron import MegatronParallel, pipeline_stages
    from services.weight_exchange.client.layouts.model import model_spec

    dense = model_spec("tiny-qwen3")   # 4 layers
    stages = pipeline_stages(dense.num_layers, 2, first=1)
    assert stages == (1, 3)
    uneven = transformer_config(dense, MegatronParallel(pp=2, layers_per_stage=stages))
    assert (uneven.num_layers_in_first_pipeline_stage, uneven.num_layers_in_last_pipeline_stage) == (1, 3)
    even = transformer_config(dense, MegatronParallel(pp=2))
    assert even.num_layers_in_first_pipeline_stage is None
    with pytest.raises(ValueError, match="^pp: 4 layers do not split evenly over 3 stages"):
        transformer_config(dense, MegatronParallel(pp=3))
    with pytest.raises(ValueError, match="^first / last: 4 layers with first=3"):
        pipeline_stages(dense.num_layers, 3, first=3)


def test_moe_settings_reach_megatron_core_and_expert_parallelism_needs_experts():
    from services.trainer.megatron.model import transformer_config
    from services.weight_exchange.client.layouts.megatron import MegatronParallel
    from services.weight_exchange.client.layouts.model import model_spec

    moe, dense = model_spec("tiny-qwen3-moe"), model_spec("tiny-qwen3")
    plain = transformer_config(moe, MegatronParallel(ep=2))
    assert plain.moe_router_load_balancing_type == "none" and plain.expert_model_parallel_size == 2
    balanced = transformer_config(moe, MegatronParallel(ep=2), moe_aux_loss_coeff=0.01)
    assert (balanced.moe_router_load_balancing_type, balanced.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    with pytest.raises(ValueError, match="^ep: expert parallelism needs a MoE model"):
        transformer_config(dense, MegatronParallel(ep=2))
    with pytest.raises(ValueError, match="^ep: 8 experts do not split evenly over ep 3"):
        transformer_config(moe, MegatronParallel(ep=3))
