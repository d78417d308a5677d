"""Dataset images by digest in the IMAGES object store, on a real nats-server: stored once, read back verified,
refused by name when missing or corrupt; with the launcher's permissions the builder (dataset images) and the rollout
(an agent session's, exported by the gateway) write them and the trainer only reads them."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from services.common.bus import Bus, InvalidMessage
from services.common.images import BUCKET, ImageStore, check_refs, ref_of

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(200))


async def test_an_image_is_stored_once_and_read_back_verified(nats_server):
    bus = await Bus.connect(nats_server.url, name="t")
    try:
        writer, reader = ImageStore(bus), ImageStore(bus, cache_bytes=0)
        ref = await writer.put(PNG)
        assert ref.sha256 == hashlib.sha256(PNG).hexdigest() and ref.size == len(PNG)
        assert await ImageStore(bus).put(PNG) == ref  # found there, not written again
        store = await bus.js.object_store(BUCKET)
        assert len(await store.list()) == 1
        assert await reader.get(ref) == PNG
        other = ref_of(b"never stored")
        with pytest.raises(InvalidMessage, match=f"no image {other.sha256}"):
            await reader.get(other)
        # bytes under another image's name are refused, never handed to a model as that image
        forged = ref_of(b"what the name promises")
        await store.put(forged.sha256, b"something else")
        with pytest.raises(InvalidMessage, match="does not hash to its name"):
            await reader.get(forged)
    finally:
        await bus.close()


def test_malformed_references_are_refused_naming_the_field():
    good = ref_of(PNG)
    check_refs([good])
    bad_digest = ref_of(PNG)
    bad_digest.sha256 = "ABC"
    with pytest.raises(InvalidMessage, match=r"images\[1\]\.sha256"):
        check_refs([good, bad_digest])
    empty = ref_of(PNG)
    empty.size = 0
    with pytest.raises(InvalidMessage, match=r"images\[0\]\.size"):
        check_refs([empty])


async def test_the_builder_and_the_gateway_write_images_and_the_trainer_only_reads_them(nats_with_auth, creds):
    async def connect(identity: str) -> Bus:
        return await asyncio.wait_for(Bus.connect(nats_with_auth.url, name=identity, deadline=20,
                                                  **creds.bus_options(identity)), 30)

    builder = await connect("builder")
    try:
        ref = await ImageStore(builder).put(PNG)
        rollout = await connect("rollout")  # reads work's images, writes an agent session's at its export
        try:
            assert await asyncio.wait_for(ImageStore(rollout).get(ref), 30) == PNG
            agents = await asyncio.wait_for(ImageStore(rollout).put(b"an agent's picture"), 30)
        finally:
            await rollout.close()
        trainer = await connect("trainer")
        try:
            assert await asyncio.wait_for(ImageStore(trainer).get(agents), 30) == b"an agent's picture"
            # the trainer cannot write: the server refuses the publish, so the put never completes
            with pytest.raises(Exception):  # noqa: B017,PT011 - a timeout or a permissions error, by version
                await asyncio.wait_for(ImageStore(trainer).put(b"not from the dataset"), 8)
        finally:
            await trainer.close()
    finally:
        await builder.close()
