"""Durable consumers belong to the service that consumes them: no other service identity may create or update one.

A real nats-server started with the users and permissions the launcher generates; every service connects as
itself through `Bus.connect` (which declares the streams and its own durable) and the refusal is the server's.
"""

from __future__ import annotations

import asyncio
import json

import nats
import nats.errors
import pytest

from services.common.auth import OPERATOR, SERVICES
from services.common.bus import CONSUMERS, Bus
from services.common.credentials import RunCredentials

JS = "$JS.API"


async def connect_as(url: str, creds: RunCredentials, identity: str, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    return await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                              error_cb=on_error, **creds.nats_connect_options(identity))


async def start_every_service(url: str, creds: RunCredentials) -> None:
    """What each service does at start: connect as itself and declare (streams, its own durable)."""
    for identity in ("builder", "reward", "rollout", "trainer", "weight_exchange"):
        bus = await asyncio.wait_for(Bus.connect(url, name=identity, deadline=20, **creds.bus_options(identity)), 30)
        await bus.close()


async def test_each_service_declares_its_own_durable_and_only_that(nats_with_auth, creds):
    await start_every_service(nats_with_auth.url, creds)
    nc = await nats.connect(nats_with_auth.url, **creds.nats_connect_options(OPERATOR))
    try:
        js = nc.jetstream(timeout=5)
        for durable, spec in CONSUMERS.items():
            info = await js.consumer_info(spec.stream, durable)
            assert info.config.filter_subject == spec.filter_subject, durable
            assert info.config.max_ack_pending == spec.max_ack_pending, durable
    finally:
        await nc.close()


async def test_reward_cannot_rewrite_the_builders_durable(nats_with_auth, creds):
    """The legacy durable-create API is create-or-update: with it, reward could set the builder's filter to
    unscored trajectories or max_ack_pending to 1. The server refuses the publish, and the consumer is as it was."""
    await start_every_service(nats_with_auth.url, creds)
    spec = CONSUMERS["builder"]
    subject = f"{JS}.CONSUMER.DURABLE.CREATE.{spec.stream}.builder"
    hostile = {"stream_name": spec.stream, "config": {
        "durable_name": "builder", "ack_policy": "explicit", "deliver_policy": "all", "filter_subject": "traj.raw",
        "max_ack_pending": 1, "ack_wait": int(10e9), "max_deliver": -1}}
    errors: list[str] = []
    nc = await connect_as(nats_with_auth.url, creds, "reward", errors)
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(subject, json.dumps(hostile).encode(), timeout=2)
        await nc.flush()
        assert any(f'permissions violation for publish to "{subject.lower()}"' in e for e in errors), errors
    finally:
        await nc.close()
    admin = await nats.connect(nats_with_auth.url, **creds.nats_connect_options(OPERATOR))
    try:
        info = await admin.jetstream(timeout=5).consumer_info(spec.stream, "builder")
        assert info.config.filter_subject == spec.filter_subject
        assert info.config.max_ack_pending == spec.max_ack_pending
    finally:
        await admin.close()


@pytest.mark.parametrize("identity", SERVICES)
async def test_only_the_owner_may_publish_a_durables_create(nats_with_auth, creds, identity):
    await start_every_service(nats_with_auth.url, creds)
    errors: list[str] = []
    nc = await connect_as(nats_with_auth.url, creds, identity, errors)
    try:
        for durable, spec in CONSUMERS.items():
            subject = f"{JS}.CONSUMER.DURABLE.CREATE.{spec.stream}.{durable}"
            await nc.publish(subject, b"")      # no reply subject and no config: nothing would change if let through
        await nc.flush()
        await asyncio.sleep(0.3)
    finally:
        await nc.close()
    for durable, spec in CONSUMERS.items():
        subject = f"{JS}.CONSUMER.DURABLE.CREATE.{spec.stream}.{durable}"
        refused = any(f'permissions violation for publish to "{subject.lower()}"' in e for e in errors)
        assert refused == (durable != identity), (identity, durable)


async def test_a_service_whose_budget_differs_from_the_builders_starts_at_once_on_the_builders_streams(
        nats_with_auth, creds):
    """F23: a service may not update streams (only the builder and the operator may); one whose nats_max_bytes
    differs from the builder's used to retry the refused update for its whole 600-s connect deadline."""
    builder = await asyncio.wait_for(Bus.connect(nats_with_auth.url, name="builder", deadline=20,
                                                 max_bytes=256 << 20, **creds.bus_options("builder")), 30)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reward = await asyncio.wait_for(Bus.connect(nats_with_auth.url, name="reward", deadline=60,
                                                    max_bytes=128 << 20, **creds.bus_options("reward")), 90)
        assert loop.time() - t0 < 15
        await reward.close()
        traj = await builder.js.stream_info("TRAJ")
        assert traj.config.max_bytes == int(0.3 * (256 << 20))  # the builder's budget stands
    finally:
        await builder.close()
