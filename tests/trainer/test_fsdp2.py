"""The fsdp2 backend with 2 real ranks (gloo on CPU) takes the steps the single-process torch backend takes on the
same batches: the same losses and final weights, and a checkpoint resumed inside the group continues exactly."""

from __future__ import annotations

import datetime
import json
import pathlib

import pytest
import torch

from services.trainer.backends.torch_backend import hf_tensors
from services.trainer.config import TrainerConfig
from services.trainer.lora import LoraConfig
from services.trainer.optim import OptimConfig
from tests.ranks import run_spawned
from tests.trainer.test_trainer_engine import NEW, engine_for, make_batch, make_model_dir

STEPS, RANKS, DEADLINE = 3, 2, 240.0
OPTIM = OptimConfig(lr=3e-3, minibatches=2)  # 8 rows a minibatch: 4 on each rank


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def train_checkpoint_retake(engine, batches: list, rank: int, checkpoint: str) -> dict:
    """Collective: train every batch, checkpointing before the last; resume from it and retake the last step.
    Returns the step metrics, rank 0's weights after the steps, and the retaken step's metrics and weights."""
    import torch.distributed as dist

    metrics = []
    for version, batch in enumerate(batches):
        if version == len(batches) - 1:
            state = {"engine": engine.state()}
            if rank == 0:
                engine.save(checkpoint, version=version, state=state)
            dist.barrier()
        metrics.append(engine.step(batch, version))
    first = {name: t.detach().clone() for name, t in engine.weights().items()}
    engine.restore(checkpoint)
    again = engine.step(batches[-1], len(batches) - 1)
    return {"metrics": metrics, "weights": first, "again_metrics": again,
            "again_weights": {name: t.detach().clone() for name, t in engine.weights().items()}}


def rank_main(rank: int, store: str, model_dir: str, batches_file: str, out_file: str) -> None:
    """One rank: join the group, train STEPS batches, checkpoint before the last, resume from it and retake it."""
    import torch.distributed as dist

    from services.trainer.engine import build_engine

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=60))
    engine = build_engine(TrainerConfig(model_path=model_dir, algo="grpo", max_new_tokens=NEW, wx_address="",
                                        optim=OPTIM, backend="fsdp2", ranks=RANKS))
    out = train_checkpoint_retake(engine, torch.load(batches_file, weights_only=False), rank, f"{out_file}.ckpt")
    params, shards = engine.local_shards()
    layout = [(s.canonical_name, s.canonical_region.offsets, s.canonical_region.sizes) for s in shards]
    out.update(local={name: t.detach().clone() for name, t in params.items()}, layout=layout)
    torch.save(out, f"{out_file}.{rank}")
    engine.close()


def run_ranks(tmp_path, model_dir: str, batches_file: str) -> list[dict]:
    out = str(tmp_path / "out")
    codes = run_spawned(rank_main, [(r, str(tmp_path / "store"), model_dir, batches_file, out) for r in range(RANKS)],
                        deadline_s=DEADLINE)
    assert codes == [0] * RANKS, f"rank exit codes {codes} (negative: killed at the {DEADLINE}s deadline)"
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(RANKS)]


def close(a: float, b: float, rel: float = 1e-5, abs_: float = 1e-6) -> bool:
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_)


def test_two_fsdp2_ranks_take_the_single_process_steps(model_dir, tmp_path):
    torch.manual_seed(0)
    single = engine_for(model_dir, "grpo", optim=OPTIM)
    batches = [make_batch(single.model, seed=s, version=s) for s in range(STEPS)]
    torch.save(batches, tmp_path / "batches.pt")
    expected = [single.step(b, v) for v, b in enumerate(batches)]
    ranks = run_ranks(tmp_path, model_dir, str(tmp_path / "batches.pt"))

    got = ranks[0]["metrics"]
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for key in ("loss", "grad_norm", "entropy", "approx_kl", "advantage_abs_mean"):
            assert close(want[key], have[key]), f"step {step} {key}: single {want[key]} vs fsdp2 {have[key]}"
    assert [m["loss"] for m in ranks[1]["metrics"]] == [m["loss"] for m in got]  # stats reduced over the ranks
    assert ranks[1]["weights"] == {}  # only rank 0 keeps full weights
    weights = single.weights()
    assert set(ranks[0]["weights"]) == set(weights)
    initial = hf_tensors(pathlib.Path(model_dir))
    moved = 0.0
    for name, tensor in weights.items():
        torch.testing.assert_close(ranks[0]["weights"][name], tensor.detach(), rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((ranks[0]["weights"][name] - initial[name]).abs().max()))
    assert moved > 1e-3  # the steps changed the weights: the comparison is not of two untrained models
    # the live shards each rank would serve to the weight exchange: its dim-0 rows, as its layout says
    for name, tensor in ranks[0]["weights"].items():
        torch.testing.assert_close(torch.cat([r["local"][name] for r in ranks]), tensor, rtol=0, atol=0, msg=name)
        rows = [next(region for n, region, _ in r["layout"] if n == name)[0] for r in ranks]
        assert rows == [0, ranks[0]["local"][name].shape[0]], name
    # one Hugging Face directory, loadable as the plain model class
    assert json.loads((tmp_path / "out.ckpt" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    # resumed from the checkpoint written before the last step, the group retakes that step exactly
    assert ranks[0]["again_metrics"]["loss"] == got[-1]["loss"]
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(ranks[0]["again_weights"][name], tensor), name


def test_the_config_names_the_field_of_a_backend_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="^backend: "):
        TrainerConfig(backend="deepspeed")
    with pytest.raises(ValueError, match="^ranks: "):
        TrainerConfig(ranks=0)
    with pytest.raises(ValueError, match="^ranks: the torch backend"):
        TrainerConfig(ranks=2)
    with pytest.raises(ValueError, match="^lora.enabled: "):
        TrainerConfig(backend="fsdp2", lora=LoraConfig(enabled=True))
    with pytest.raises(ValueError, match="^backend: fsdp2 .* 'ppo'"):
        TrainerConfig(backend="fsdp2", algo="ppo")
    with pytest.raises(ValueError, match="^rank_timeout: "):
        TrainerConfig(backend="fsdp2", rank_timeout=0)


def test_ranks_without_a_group_environment_are_refused(model_dir, monkeypatch):
    from services.trainer.backends import group

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="^ranks: 2 ranks are started by"):
        group.join(TrainerConfig(model_path=model_dir, backend="fsdp2", ranks=2))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="^ranks: a trainer rank needs"):
        group.env_rank()


def test_missing_device_libraries_name_the_device():
    from services.trainer.backends.group import collective_backend

    assert collective_backend("cpu") == "gloo"
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="^device: npu needs torch_npu"):
            collective_backend("npu")


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_ranks_scaled_losses_average_to_the_whole_minibatchs_loss(mode, world):
    """FSDP averages the ranks' gradients, so the mean of the scaled losses must be the single-process loss, in
    every aggregation mode, also with more ranks than rows (a rank without rows contributes 0)."""
    from services.trainer.algorithms.aggregation import aggregate, loss_weight
    from services.trainer.backends.shards import RowShards

    g = torch.Generator().manual_seed(world)
    values = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[2] = 0  # a row without trained tokens
    part = torch.randperm(6, generator=g)
    whole = aggregate(values[part], mask[part], mode, norm_constant=4)
    scaled = []
    for rank in range(world):
        rows, scale, weight = RowShards(rank, world, torch.device("cpu")).split(part, mask, lambda m: loss_weight(m, mode))
        scaled.append(scale * aggregate(values[rows], mask[rows], mode, norm_constant=4))
        assert weight == (loss_weight(mask[rows], mode) if scale else 0.0)
    torch.testing.assert_close(sum(scaled) / world, whole)
