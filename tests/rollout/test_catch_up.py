"""A (re)started rollout does not generate with stale weights: its pull gate stays closed until the weight
exchange has brought the engine to the trainer's version (or `catch_up_timeout` passes).

Real gRPC servers on loopback: the weight-exchange service in the test's loop, a sender, the rollout's receiver.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from launcher.processes import free_port
from services.common.rpc import start_server
from services.rollout.config import RolloutConfig
from services.rollout.engines.torch_engine import EmbeddedEngine
from services.rollout.server import Rollout, _weight_receiver, open_when_current
from services.weight_exchange.client import SenderAgent
from services.weight_exchange.config import WeightExchangeConfig
from services.weight_exchange.server import serve


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return Qwen3ForCausalLM(config).eval()


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


@contextlib.asynccontextmanager
async def weight_exchange(sender_version: int | None, *, updating: bool = False):
    """The service and one sender (a trainer rank at `sender_version`); yields (address, trainer weights)."""
    address = f"127.0.0.1:{free_port()}"
    stop = asyncio.Event()
    service = asyncio.create_task(serve(WeightExchangeConfig(grpc_address=address, nats_url="", metrics_port=-1,
                                                             transfer_timeout=10.0), stop))
    trained = params(tiny_model(1))
    sender = SenderAgent("trainer-0", trained, address, transports=("tcp",), version=sender_version)
    await sender.open()
    if updating:
        sender.begin_update()    # a training step that never ends: every read is refused
    beat = asyncio.create_task(sender.keep_registered(stop, 0.2))
    try:
        await sender.registered.wait()
        yield address, trained
    finally:
        stop.set()
        await asyncio.gather(beat, service)
        await sender.close()


@contextlib.asynccontextmanager
async def rollout(wx_address: str, catch_up_timeout: float):
    engine = EmbeddedEngine(tiny_model(0), eos_token_id=1, pad_token_id=0, max_batch=4, max_context=64, seed=0)
    engine.start()
    config = RolloutConfig(wx_address=wx_address, catch_up_timeout=catch_up_timeout, nats_url="", metrics_port=-1)
    r = Rollout(config, engine, bus=None)  # type: ignore[arg-type]  (no prompt work in these tests)
    receiver = _weight_receiver(config, engine)
    rpc = await start_server("127.0.0.1:0", [receiver.servicer()])
    r.hold("weights")
    stop = asyncio.Event()
    tasks = [asyncio.create_task(receiver.keep_registered(stop, 0.2, agent_address=f"127.0.0.1:{rpc.port}")),
             asyncio.create_task(open_when_current(r, receiver, catch_up_timeout, stop))]
    try:
        yield r
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await receiver.close()
        await rpc.stop(0)
        engine.stop()


async def test_gate_stays_closed_until_the_engine_has_the_trainers_version():
    async with weight_exchange(3) as (address, trained), rollout(address, catch_up_timeout=60) as r:
        assert not r.pull_gate.is_set()
        await asyncio.wait_for(r.pull_gate.wait(), 30)
        assert r.engine.version == 3 and r.engine.stats.weight_updates == 1
        got = r.engine.named_parameters()
        assert all(torch.equal(got[k], v) for k, v in trained.items())


async def test_fresh_run_opens_at_once():
    async with weight_exchange(0) as (address, _), rollout(address, catch_up_timeout=60) as r:
        await asyncio.wait_for(r.pull_gate.wait(), 10)
        assert r.engine.version == 0 and r.engine.stats.weight_updates == 0


async def test_gate_opens_after_the_timeout_when_catch_up_cannot_finish():
    async with weight_exchange(3, updating=True) as (address, _), rollout(address, catch_up_timeout=1.0) as r:
        await asyncio.sleep(0.5)
        assert not r.pull_gate.is_set()
        await asyncio.wait_for(r.pull_gate.wait(), 10)
        assert r.engine.version == 0    # generating with the old weights, after a warning


async def test_gate_opens_after_the_timeout_without_weight_exchange():
    async with rollout(f"127.0.0.1:{free_port()}", catch_up_timeout=0.5) as r:
        assert not r.pull_gate.is_set()
        await asyncio.wait_for(r.pull_gate.wait(), 10)


async def test_rpc_pause_outlasts_the_catch_up():
    async with weight_exchange(0) as (address, _), rollout(address, catch_up_timeout=60) as r:
        r.hold("rpc")
        await asyncio.sleep(0.6)
        assert "weights" not in r.holds and not r.pull_gate.is_set()
        r.release("rpc")
        assert r.pull_gate.is_set()
