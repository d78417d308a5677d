"""Each megatron rank a sender (``shard_sync``): the ranks of the megatron backend — tensor parallel on the tiny
Qwen3, expert parallel on the tiny Qwen3-MoE (beside data parallel, or beside tensor parallel with whole experts),
two uneven pipeline stages (1 + 3 layers) on the tiny Qwen3, alone and (four ranks) each split over two tensor
parallel ranks — after a training step serve their own live shards to a real weight-exchange service, and a receiver holding the Hugging Face layout (fused experts, for the MoE) gets
exactly the weights the group trained — each byte once, pulled from the rank that holds it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.trainer.config import MegatronConfig, TrainerConfig
from tests.marks import full
from tests.ranks import join_cpu_group, leave_cpu_group, run_spawned
from tests.trainer.test_trainer_engine import NEW, engine_for, make_batch
from tests.weight_exchange.test_sync_path import sync_stack
from tests.weight_exchange.tiny import VOCAB

pytest.importorskip("megatron.core")

DEADLINE, VERSION = 300.0, 1

# parallel sizes, MoE experts, ranks
CASES = {"tp=2": ({"tp": 2}, 0, 2), "moe:ep=2,dp=2": ({"ep": 2}, 4, 2),
         "moe:tp=2,ep=2,etp=1": ({"tp": 2, "ep": 2, "etp": 1}, 4, 2),
         "pp=2:first=1": ({"pp": 2, "num_layers_in_first_pipeline_stage": 1}, 0, 2),
         "tp=2,pp=2:first=1": ({"tp": 2, "pp": 2, "num_layers_in_first_pipeline_stage": 1}, 0, 4)}
IN_MAKE_TEST = {"moe:tp=2,ep=2,etp=1", "pp=2:first=1"}  # tensor, expert and pipeline ranks; the rest: make test-full


@pytest.fixture(scope="module", params=[c if c in IN_MAKE_TEST else full(c) for c in CASES])
def case(request, tmp_path_factory):
    """(parallel sizes, the trainer's model directory, the running stack): the receiver's architecture (the built-in
    tiny Qwen3, or its Qwen3-MoE with 4 experts), the trainer's at other weights."""
    from services.trainer.models import TinyQwen3Config, build_tokenizer

    sizes, experts, world = CASES[request.param]
    path = tmp_path_factory.mktemp("tiny-sync")
    torch.manual_seed(3)
    TinyQwen3Config(num_experts=experts).build(VOCAB).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    with sync_stack(tmp_path_factory.mktemp("sync"), "--experts", str(experts)) as stack:
        yield sizes, world, str(path), stack


async def serve_and_sync(engine, rank: int, address: str) -> dict:
    import torch.distributed as dist

    from services.weight_exchange.client import SenderAgent

    params, shards = engine.local_shards()
    framework, parallel = engine.sender_layout()
    sender = SenderAgent(f"trainer-0-r{rank}" if rank else "trainer-0", params, address, transports=("tcp",),
                         shards=shards, framework=framework, parallel=parallel, version=VERSION)
    await sender.start()
    out: dict = {}
    try:
        await asyncio.to_thread(dist.barrier)   # both ranks registered
        if rank == 0:
            reply = await sender.sync(VERSION, timeout=60.0, transport="tcp", verify=True)
            out = {"bytes_moved": reply.bytes_moved, "num_receivers": reply.num_receivers,
                   "local_bytes": sum(t.numel() * t.element_size() for t in params.values())}
        await asyncio.to_thread(dist.barrier)   # rank 1 serves until rank 0's sync is done
    finally:
        await sender.close()
    return out


def rank_main(rank: int, world: int, store: str, model_dir: str, sizes: dict[str, int], batch_file: str, address: str,
              out_file: str) -> None:
    from services.trainer.engine import build_engine

    torch.set_num_threads(1)
    join_cpu_group(rank, world, store)
    engine = build_engine(TrainerConfig(model_path=model_dir, algo="grpo", max_new_tokens=NEW, wx_address="",
                                        backend="megatron", ranks=world, megatron=MegatronConfig(**sizes),
                                        shard_sync=True))
    before = {name: t.detach().clone() for name, t in engine.weights().items()}
    engine.step(torch.load(batch_file, weights_only=False), 0)
    out = asyncio.run(serve_and_sync(engine, rank, address))
    # with shard_sync, rank 0 gathers a full copy only for a checkpoint (gather_weights), not after each step
    out["stale"] = all(torch.equal(t, before[name]) for name, t in engine.weights().items())
    engine.gather_weights()
    out["weights"] = {name: t.detach().clone() for name, t in engine.weights().items()}
    torch.save(out, f"{out_file}.{rank}")
    leave_cpu_group()


def test_megatron_ranks_each_send_their_own_shards_into_the_receiver(case, tmp_path):
    sizes, world, model_dir, stack = case
    single = engine_for(model_dir, "grpo")
    torch.save(make_batch(single.model, seed=0, version=0), tmp_path / "batch.pt")
    out = str(tmp_path / "out")
    codes = run_spawned(rank_main, [(r, world, str(tmp_path / "store"), model_dir, sizes, str(tmp_path / "batch.pt"),
                                     stack["address"], out) for r in range(world)], deadline_s=DEADLINE)
    assert codes == [0] * world, f"rank exit codes {codes} (negative: killed at the {DEADLINE}s deadline)"
    rank0, *others = (torch.load(f"{out}.{r}", weights_only=False) for r in range(world))
    trained = rank0["weights"]   # rank 0's gathered copy of what the group trained
    got = torch.load(stack["out"] / f"v{VERSION}.pt")
    assert got.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(got[name], tensor), name
    initial = single.weights()
    assert any(not torch.equal(trained[n], initial[n].detach()) for n in trained)  # the step moved the weights
    full = sum(t.numel() * t.element_size() for t in trained.values())
    assert rank0["num_receivers"] == 1 and rank0["bytes_moved"] == full  # every byte once: the minimum
    assert rank0["local_bytes"] < full  # rank 0 alone does not hold the model: the others' shards came from them
    assert rank0["stale"]  # the step did not gather: the receiver's bytes came from the ranks' own shards
    for other in others:   # the other ranks gather nothing and ask for no sync
        assert other["weights"] == {} and "bytes_moved" not in other
