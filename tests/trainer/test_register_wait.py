"""The trainer's first registration with the weight exchange has a deadline: with nothing at `wx_address` it fails
naming the address instead of idling forever before its first step."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from launcher.processes import free_port
from services.trainer.server import wait_registered
from services.weight_exchange.client import SenderAgent


async def test_no_weight_exchange_at_the_address_fails_within_the_deadline_naming_it():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    sender = SenderAgent("trainer-0", {"w": torch.zeros(4)}, address, transports=("tcp",), version=0)
    await sender.open()
    stop = asyncio.Event()
    beat = asyncio.create_task(sender.keep_registered(stop, interval=0.5))
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=rf"not registered with the weight exchange at {address} within 2s"):
            await wait_registered(sender, stop, address, timeout=2.0)
        assert time.monotonic() - started < 20
    finally:
        stop.set()
        await asyncio.wait_for(beat, 60)
        await sender.close()


async def test_a_stop_ends_the_wait_without_an_error():
    sender = SenderAgent("trainer-0", {"w": torch.zeros(4)}, f"127.0.0.1:{free_port()}", transports=("tcp",))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    await asyncio.wait_for(wait_registered(sender, stop, "wx", timeout=60.0), 10)
    assert not sender.registered.is_set()
