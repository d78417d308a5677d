"""Delta updates: a sender in fp32, a receiver in bf16, the whole exchange in this process (service, sender and
receiver agents over loopback gRPC, pulls over tcp and shm)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from services.weight_exchange.bench.local import local_exchange
from services.weight_exchange.client import delta
from tests.weight_exchange.tiny import tiny_qwen3

pytestmark = pytest.mark.timeout(300)


# the pure parts --------------------------------------------------------------------------------------------------

def test_changed_compares_bits():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0, -0.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.5, -0.0], dtype=torch.bfloat16)
    # a signed zero changed; the same NaN did not
    assert np.flatnonzero(delta.changed_mask(new, base)).tolist() == [0, 3]


def test_sparse_only_when_smaller():
    assert delta.sparse_is_smaller(10, 100, 2)          # 10 * (4 + 2) < 200
    assert not delta.sparse_is_smaller(34, 100, 2)      # 204 >= 200: the whole region instead


def test_the_store_keeps_the_two_latest_versions():
    store = delta.DeltaStore()
    key = ("w", (0,), (4,), "bfloat16")
    for v in (1, 2, 3):
        store.keep({key: torch.full((4,), float(v))}, v)
    assert store.base(key, 1) is None and store.base(key, 2) is not None and store.base(key, 3) is not None
    store.keep({key: torch.zeros(4)}, 2)                # served again (a second replica): most recent now
    store.keep({key: torch.ones(4)}, 4)
    assert store.base(key, 3) is None and store.base(key, 2) is not None


def test_a_sparse_delta_lands_in_a_strided_view():
    full = torch.zeros(4, 6)
    view = full[:, 2:5]                                 # a column shard: not contiguous
    delta.apply_sparse(view, torch.tensor([0, 4, 11]), torch.tensor([1.0, 2.0, 3.0]))
    assert full[0, 2] == 1 and full[1, 3] == 2 and full[3, 4] == 3 and full.sum() == 6


# through the exchange ----------------------------------------------------------------------------------------------

def small_step(params: dict[str, torch.Tensor], seed: int, scale: float = 1e-4) -> None:
    """An optimizer-sized change of every fp32 weight: most bf16 values keep their bits."""
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        p.add_(torch.randn(p.shape, generator=g) * scale * (p.abs().mean() + 1e-3))


def receiver_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}


def identical(received: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(received[n], params[n].to(torch.bfloat16)) for n in received)


async def test_fifty_deltas_are_bit_identical_to_a_full_sync_and_small():
    model = tiny_qwen3(seed=1)
    params = dict(model.named_parameters())
    received = receiver_of(model)
    async with local_exchange(params, {"params": received, "version": 0}, delta=True, full_every=100) as wx:
        first = await wx.update(1, lambda p: small_step(p, 0), transport="tcp")
        # full over tcp: the sender casts, so the receiver's bf16 bytes travel, not the trainer's fp32
        assert not first.delta and first.bytes_moved == sum(t.numel() * 2 for t in received.values())
        assert identical(received, params)
        fractions = []
        for v in range(2, 52):
            reply = await wx.update(v, lambda p, v=v: small_step(p, v), transport="shm" if v % 2 else "tcp")
            assert reply.delta and reply.version == v
            fractions.append(reply.bytes_moved / reply.bytes_full)
        assert identical(received, params)
        assert reply.bytes_full == sum(t.numel() * 2 for t in received.values())   # bf16: the receiver's bytes
        assert max(fractions) < 0.5 and sum(fractions) / len(fractions) < 0.25, fractions
        assert wx.sender.server.deltas.num_bytes() <= 2 * reply.bytes_full          # two versions kept at most


@pytest.mark.parametrize("transport, itemsize", [("tcp", 2), ("shm", 4)])
async def test_a_full_update_moves_the_receivers_dtype_over_tcp_and_the_senders_over_shared_memory(transport,
                                                                                                 itemsize):
    """fp32 sender, bf16 receiver: tcp's sender casts each region (half the bytes); shm reads the sender's memory
    as it is and the receiver casts. Either way the receiver holds the round-to-nearest bf16 of every weight, and
    the sender's checksums (of what it sent) check out."""
    model = tiny_qwen3(seed=4)
    params = dict(model.named_parameters())
    received = {n: torch.zeros_like(t) for n, t in receiver_of(model).items()}
    async with local_exchange(params, {"params": received, "version": 0}, delta=False) as wx:
        reply = await wx.update(1, lambda p: small_step(p, 1), transport=transport, verify=True)
        assert reply.bytes_moved == sum(t.numel() * itemsize for t in received.values())
        assert identical(received, params)


async def test_a_full_update_every_k_and_after_a_corrupted_receiver():
    model = tiny_qwen3(seed=2)
    params = dict(model.named_parameters())
    received = receiver_of(model)
    name = next(iter(received))
    async with local_exchange(params, {"params": received, "version": 0}, delta=True, full_every=3) as wx:
        kinds = [(await wx.update(v, lambda p, v=v: small_step(p, v))).delta for v in range(1, 8)]
        assert kinds == [False, True, True, False, True, True, False]
        await wx.update(8, lambda p: small_step(p, 8))              # a delta again
        received[name].view(-1)[0] += 1.0                           # the receiver's copy no longer matches
        reply = await wx.update(9, lambda p: small_step(p, 9))
        # the delta's checksum failed on the receiver; the same Sync sent it everything
        assert not reply.delta and identical(received, params)


async def test_a_restarted_receiver_or_sender_gets_a_full_update():
    from services.common.rpc import start_server
    from services.weight_exchange.client import ReceiverAgent, SenderAgent

    model = tiny_qwen3(seed=3)
    params = dict(model.named_parameters())
    received = receiver_of(model)
    async with local_exchange(params, {"params": received, "version": 0}, delta=True, full_every=100) as wx:
        await wx.update(1, lambda p: small_step(p, 1))
        assert (await wx.update(2, lambda p: small_step(p, 2))).delta
        # the receiver process restarts: a new agent (new key, new address) under the same rank id
        again = receiver_of(model)
        agent = ReceiverAgent("rollout-0", again, wx.address, version=2)
        server = await start_server("127.0.0.1:0", [agent.servicer()])
        try:
            await agent.register(f"127.0.0.1:{server.port}")
            reply = await wx.update(3, lambda p: small_step(p, 3))
            assert not reply.delta and identical(again, params)
            assert (await wx.update(4, lambda p: small_step(p, 4))).delta
            # the sender restarts: what it served is gone, so every receiver's next update is full
            await wx.sender.close()
            wx.sender = SenderAgent("trainer-0", params, wx.address, version=4)
            await wx.sender.start()
            reply = await wx.update(5, lambda p: small_step(p, 5))
            assert not reply.delta and identical(again, params)
        finally:
            await wx.sender.close()
            await agent.close()
            await server.stop(0)


async def test_without_delta_nothing_is_kept_and_every_update_is_full():
    model = tiny_qwen3(seed=4)
    params = dict(model.named_parameters())
    received = receiver_of(model)
    async with local_exchange(params, {"params": received, "version": 0}) as wx:
        for v in (1, 2):
            reply = await wx.update(v, lambda p, v=v: small_step(p, v))
            assert not reply.delta
        assert wx.sender.server.deltas.num_bytes() == 0 and identical(received, params)
    await asyncio.sleep(0)
