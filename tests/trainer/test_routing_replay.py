"""MoE routing replay (R3): the embedded engine records the experts every fed token was routed to, exactly as a
forward of the whole sequence routes them (through prefix-cache hits, decode steps merged with admitted rows and
a weight update mid-generation); the routes travel in the trajectory; the trainer's forwards (padded and packed,
the torch backend and megatron-core ranks) route each token to its recorded experts, which reproduces the
engine's log-probs and, when the records differ from the trainer's own routing, changes them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.moe_routing import routers_of, to_proto
from services.common.routed_experts import encode
from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig
from services.trainer.batching import pack
from services.trainer.config import MegatronConfig, TrainerConfig
from services.trainer.forward import frozen_logp
from services.trainer.packing import PackingConfig, packed_forwards
from tests.trainer.test_trainer_engine import NEW, engine_for, make_batch, make_model_dir

DEADLINE = 300.0


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny-moe"), layers=2, kv_heads=2, experts=4)


def own_routes(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers, top_k]: how one forward of the whole sequence routes each token (order within a token's
    top-k is the router's own)."""
    routers = routers_of(model)
    with torch.no_grad(), routers.record() as recording:
        model(input_ids=torch.tensor([ids]))
    return torch.stack([layer[-1] for layer in recording], dim=1)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.sort(-1).values.long(), b.sort(-1).values.long())


def generate(engine, prompts: list[list[int]], n: int, new: int) -> list:
    async def run():
        sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True)
        return await asyncio.gather(*(engine.generate(p, sampling, n=n) for p in prompts))
    return [seq for group in asyncio.run(asyncio.wait_for(run(), DEADLINE)) for seq in group]


def trajectories(seqs: list, version: int = 0) -> list[data_pb2.Trajectory]:
    return [data_pb2.Trajectory(
        trajectory_id=f"t{i}", group_id=f"g{i // 2}", prompt_ids=s.prompt_ids, completion_ids=s.output_ids,
        behavior_logprobs=s.logprobs, versions=s.versions, loss_mask=[1] * len(s.output_ids), reward=float(i % 2),
        routed_experts=to_proto(s.routes, len(s.prompt_ids) + len(s.output_ids))) for i, s in enumerate(seqs)]


# the engine records -------------------------------------------------------------------------------------------

def test_the_engine_records_what_a_whole_sequence_forward_routes(moe_dir):
    """Rows of different lengths decode together and admitted rows merge into the batch (max_batch 3 of 6),
    a second round of the same long prompts hits the prefix cache: every trajectory's routes are those of a
    forward of its prompt + completion, for all but its last token (never fed)."""
    engine = EngineConfig(model_path=moe_dir, record_routes=True, max_batch=3, max_context=256,
                          prefix_cache_mb=16).build()
    engine.start()
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 120, (40 + 7 * i,), generator=g).tolist() for i in range(3)]
        seqs = generate(engine, prompts, n=2, new=6)
        seqs += generate(engine, prompts, n=1, new=9)  # the prompts' KV (and routes) come from the prefix cache
        assert engine.runner.prefix.stats.hit_tokens >= 3 * 32
    finally:
        engine.stop()
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    for seq in seqs:
        traj = trajectories([seq])[0]
        routes = torch.from_numpy(np.frombuffer(traj.routed_experts.indices, "<u2").astype(np.int64)).view(-1, 2, 2)
        ids = seq.prompt_ids + seq.output_ids
        assert len(routes) == len(ids) - 1
        assert same_sets(routes, own_routes(model, ids)[:-1])


def test_after_a_weight_update_mid_generation_the_routes_are_the_new_weights(moe_dir):
    """The resume re-prefills every row under the new weights: the tokens fed before the update are routed again,
    and the record follows (the trainer replays what the last forward of each token chose)."""
    engine = EngineConfig(model_path=moe_dir, record_routes=True, max_context=256).build()
    engine.start()
    try:
        prompt = list(range(5, 45))
        async def run():
            sampling = Sampling(temperature=1.0, max_new_tokens=40, ignore_eos=True)
            task = asyncio.ensure_future(engine.generate(prompt, sampling, n=2))
            while engine.stats.tokens_generated < 4:
                await asyncio.sleep(0.001)
            await engine.pause_async()
            with torch.no_grad():
                for router in routers_of(engine.model).routers:
                    router.weight.mul_(-1.0)  # every token now prefers the experts it liked least
            await engine.resume_async(version=1)
            return await task
        seqs = asyncio.run(asyncio.wait_for(run(), DEADLINE))
    finally:
        engine.stop()
    flipped = AutoModelForCausalLM.from_pretrained(moe_dir)
    with torch.no_grad():
        for router in routers_of(flipped).routers:
            router.weight.mul_(-1.0)
    for seq in seqs:
        assert set(seq.versions) == {0, 1}, "the update landed mid-generation"
        ids = seq.prompt_ids + seq.output_ids
        routes = torch.cat(seq.routes)
        assert same_sets(routes, own_routes(flipped, ids)[:-1])


# the trainer replays -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rollout(moe_dir):
    """8 rows with recorded routes from a float32 engine."""
    engine = EngineConfig(model_path=moe_dir, record_routes=True, max_context=256).build()
    engine.start()
    try:
        g = torch.Generator().manual_seed(1)
        seqs = generate(engine, [torch.randint(3, 120, (12 + i,), generator=g).tolist() for i in range(4)], n=2,
                        new=12)
    finally:
        engine.stop()
    return trajectories(seqs)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replayed_routes_give_the_engines_log_probs_and_other_routes_change_them(moe_dir, rollout, packed):
    batch = pack(rollout, pad_token_id=0)
    assert batch.routes.shape[2:] == (2, 2) and int((batch.routes >= 0).all(-1).all(-1).sum()) == sum(
        len(t.prompt_ids) + len(t.completion_ids) - 1 for t in rollout)
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    mask = batch.loss_mask.bool()
    routers = routers_of(model)
    with packed_forwards(PackingConfig(enabled=packed)):
        replayed = frozen_logp(model, batch, 1.0)
        stats = routers.take_stats()
        torch.testing.assert_close(replayed[mask], batch.behav_logp[mask], rtol=0, atol=5e-5)
        assert stats["routing_replayed"] > 0 and stats["routing_differed"] == 0.0  # float32 on both sides
        other = batch.rows(torch.arange(batch.size))
        other.routes = torch.where(other.routes >= 0, (other.routes + 1) % 4, other.routes)  # experts 0123 -> 1230
        moved = frozen_logp(model, other, 1.0)
        assert (moved[mask] - replayed[mask]).abs().max() > 1e-2
        assert routers.take_stats()["routing_differed"] > 0.5
        unrecorded = batch.rows(torch.arange(batch.size))
        unrecorded.routes = torch.full_like(batch.routes, -1)  # no record: each token routes itself
        torch.testing.assert_close(frozen_logp(model, unrecorded, 1.0), replayed, rtol=0, atol=1e-6)
        assert routers.take_stats()["routing_replayed"] == 0


def test_gradients_flow_through_the_replayed_experts_router_probabilities(moe_dir, rollout):
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    routers = routers_of(model)
    batch = pack(rollout, pad_token_id=0)
    with routers.replay(batch.routes.reshape(-1, 2, 2)):
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers.routers)


def test_the_torch_backend_steps_with_replay_and_reports_it(moe_dir, rollout):
    engine = engine_for(moe_dir, "grpo", routing_replay=True)
    metrics = engine.step(pack(rollout, pad_token_id=0), 0)
    # the minibatches after the first update route some tokens otherwise: those are the ones replay keeps
    assert metrics["routing_replayed"] > 0 and 0.0 < metrics["routing_differed"] < 0.5
    assert "routing_replayed" not in engine_for(moe_dir, "grpo").step(pack(rollout, pad_token_id=0), 0)


# bad input -------------------------------------------------------------------------------------------------------

def test_routing_replay_on_a_dense_model_is_refused_naming_the_field(tmp_path):
    with pytest.raises(FieldError, match="routing_replay: .*no MoE router"):
        engine_for(make_model_dir(tmp_path / "dense"), "grpo", routing_replay=True)
    with pytest.raises(FieldError, match="routing_replay: .*pipeline"):
        TrainerConfig(model_path="x", backend="megatron", ranks=2, megatron=MegatronConfig(pp=2), routing_replay=True)


def test_malformed_routes_are_refused_naming_the_field(rollout):
    from services.common.bus import InvalidMessage
    from services.reward.scoring import validate_trajectory

    t = data_pb2.Trajectory()
    t.CopyFrom(rollout[0])
    t.routed_experts.indices = t.routed_experts.indices[:-1]
    with pytest.raises(InvalidMessage, match="routed_experts.indices"):
        validate_trajectory(t)
    with pytest.raises(ValueError, match="routed_experts.indices: .* in t0"):
        pack([t], pad_token_id=0)
    t.routed_experts.CopyFrom(encode(np.zeros((len(t.prompt_ids) + len(t.completion_ids) + 1, 2, 2), np.int64)))
    with pytest.raises(InvalidMessage, match="routed_experts: .* positions for"):
        validate_trajectory(t)
    t.routed_experts.CopyFrom(encode(np.zeros((3, 1, 2), np.int64)))
    with pytest.raises(ValueError, match="routed_experts: 1 layers x top-2 in t0, 2 x top-2"):
        pack([rollout[1], t], pad_token_id=0)


def test_routes_recorded_for_another_model_are_refused_naming_the_field(moe_dir, rollout):
    t = data_pb2.Trajectory()
    t.CopyFrom(rollout[0])
    t.routed_experts.CopyFrom(encode(np.zeros((3, 1, 2), np.int64)))  # one layer: not this model's two
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    routers_of(model)
    with pytest.raises(ValueError, match=r"routed_experts: recorded for \(1, 2\)"):
        frozen_logp(model, pack([t], pad_token_id=0), 1.0)


# megatron-core ranks ---------------------------------------------------------------------------------------------

def replay_rank(rank: int, world: int, store: str, model_dir: str, sizes: dict, batches_file: str, out: str) -> None:
    from services.trainer.engine import build_engine
    from tests.ranks import join_cpu_group, leave_cpu_group
    from tests.trainer.test_megatron_backend import OPTIM

    torch.set_num_threads(1)
    join_cpu_group(rank, world, store)
    engine = build_engine(TrainerConfig(model_path=model_dir, algo="grpo", max_new_tokens=NEW, wx_address="",
                                        backend="megatron", ranks=world, megatron=MegatronConfig(**sizes),
                                        optim=OPTIM, routing_replay=True, run_dir=f"{out}.run"))
    metrics = [engine.step(b, v) for v, b in enumerate(torch.load(batches_file, weights_only=False))]
    torch.save({"metrics": metrics, "weights": {k: t.detach().clone() for k, t in engine.weights().items()}},
               f"{out}.{rank}")
    leave_cpu_group()


def with_routes(batch, seed: int):
    """The batch with recorded routes no router would choose (random pairs of experts), on every position but
    each row's last: megatron and torch only agree if both replay them."""
    g = torch.Generator().manual_seed(seed)
    rows, width = batch.input_ids.shape
    routes = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(rows * width * 2)]).view(rows, width, 2, 2)
    last = batch.attention_mask.sum(-1) - 1
    routes[torch.arange(width)[None, :] >= last[:, None]] = -1
    batch.routes = routes.to(torch.int16)
    return batch


@pytest.mark.parametrize("sizes", [{"ep": 2}, {"tp": 2, "ep": 2, "etp": 1}], ids=["ep=2", "tp=2,ep=2,etp=1"])
def test_megatron_ranks_replay_as_the_torch_backend_does(moe_dir, tmp_path, sizes):
    pytest.importorskip("megatron.core")
    from tests.ranks import run_spawned
    from tests.trainer.test_megatron_backend import OPTIM, close

    torch.manual_seed(0)
    single = engine_for(moe_dir, "grpo", optim=OPTIM, routing_replay=True)
    batches = [with_routes(make_batch(single.model, seed=s, version=s), seed=s) for s in range(2)]
    torch.save(batches, tmp_path / "batches.pt")
    expected = [single.step(b, v) for v, b in enumerate(batches)]
    assert all(m["routing_differed"] > 0.3 for m in expected), "the routes are not the model's own"
    codes = run_spawned(replay_rank, [(r, 2, str(tmp_path / "store"), moe_dir, sizes, str(tmp_path / "batches.pt"),
                                       str(tmp_path / "out")) for r in range(2)], deadline_s=DEADLINE)
    assert codes == [0, 0], f"rank exit codes {codes} (negative: killed at the {DEADLINE}s deadline)"
    got = torch.load(tmp_path / "out.0", weights_only=False)
    for step, (want, have) in enumerate(zip(expected, got["metrics"], strict=True)):
        for key in ("loss", "grad_norm", "entropy", "approx_kl"):
            assert close(want[key], have[key]), f"step {step} {key}: torch {want[key]} vs megatron {have[key]}"
        assert have["routing_replayed"] > 0
    for name, tensor in single.weights().items():
        torch.testing.assert_close(got["weights"][name], tensor.detach(), rtol=1e-4, atol=5e-5, msg=name)
