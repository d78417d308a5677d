"""Training batches on the BATCHES stream, one subject per index (`batches.train.<index>`).

The stream keeps them (limits retention), so the trainer reads batch i by index (a restarted trainer
re-reads what its last checkpoint does not cover) and a restarted builder learns which groups it has
batched. A batch over the server's `max_payload` lives whole in the `BATCH_BLOBS` object store; the
stream then carries a pointer (same index and group ids, no trajectories, `object_name` set).

An index is written once: every publish expects the subject to be empty (`Nats-Expected-Last-Subject-Sequence:
0`), whatever the dedupe window, so a second builder (or a late retry) can never put a different batch under an
index the trainer may already have trained; the same batch again is a duplicate, another one `BatchConflict`.
Blob names carry a digest of the group ids, so a conflicting batch never overwrites the blob a pointer names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib

import nats.js.errors
from nats.js.api import ObjectStoreConfig

from services.common.bus import BLOBS_SHARE, SUBJECT_BATCHES, Bus, InvalidMessage, PayloadTooLarge, retry
from services.common.contracts import data_pb2

STREAM = "BATCHES"
BLOBS = "BATCH_BLOBS"
INDEX_HEADER = "Meshrl-Batch-Index"
EXPECT_EMPTY = {"Nats-Expected-Last-Subject-Sequence": "0"}
WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code when the subject already holds a message


class BatchConflict(RuntimeError):
    """Another batch is already published under this index: two builders, or a diverged one. Fatal."""


def batch_subject(index: int) -> str:
    assert index >= 0
    return f"{SUBJECT_BATCHES}.{index}"


@dataclasses.dataclass(frozen=True)
class PublishedBatch:
    index: int
    group_ids: tuple[str, ...]
    trajectory_ids: tuple[str, ...]


async def publish_batch(bus: Bus, batch: data_pb2.TrainingBatch) -> bool:
    """Publish batch `batch.index` once. False: this same batch (its group ids) was already there;
    BatchConflict: a different one is."""
    try:
        return await _publish_once(bus, batch)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != WRONG_LAST_SEQUENCE:
            raise
    existing = await read_batch(bus, batch.index)
    if existing is not None and list(existing.group_ids) == list(batch.group_ids):
        return False
    theirs = list(existing.group_ids)[:4] if existing is not None else "unreadable"
    raise BatchConflict(f"batches.train.{batch.index}: already holds another batch (groups {theirs}..., ours "
                        f"{list(batch.group_ids)[:4]}...): is a second builder running?")


async def _publish_once(bus: Bus, batch: data_pb2.TrainingBatch) -> bool:
    msg_id = f"batch-{batch.index}"
    headers = {INDEX_HEADER: str(batch.index), **EXPECT_EMPTY}
    try:
        return await bus.publish(batch_subject(batch.index), batch, msg_id, headers=headers)
    except PayloadTooLarge:
        pass
    store = await _blobs(bus)
    name = blob_name(batch)
    await retry(lambda: store.put(name, batch.SerializeToString()), what=f"store {name}")
    pointer = data_pb2.TrainingBatch(batch_id=batch.batch_id, index=batch.index, created_at=batch.created_at,
                                     dropped_stale=batch.dropped_stale, group_ids=batch.group_ids, object_name=name)
    return await bus.publish(batch_subject(batch.index), pointer, msg_id, headers=headers)


def blob_name(batch: data_pb2.TrainingBatch) -> str:
    """`batch-<index>-<digest of its group ids>`: the same batch, the same name; another batch, another."""
    digest = hashlib.sha256("\n".join(batch.group_ids).encode()).hexdigest()[:16]
    return f"batch-{batch.index}-{digest}"


async def read_batch(bus: Bus, index: int) -> data_pb2.TrainingBatch | None:
    """Batch `index` (resolving an object-store pointer), or None when it has not been published yet.

    InvalidMessage when what is stored under the index is not a readable training batch.
    """
    async def get():
        try:
            return await bus.js.get_last_msg(STREAM, batch_subject(index))
        except nats.js.errors.NotFoundError:
            return None

    raw = await retry(get, what=f"read batch {index}")
    if raw is None:
        return None
    batch = _decode(raw.data, f"batch {index}")
    if batch.object_name:
        store = await _blobs(bus)
        try:
            result = await retry(lambda: store.get(batch.object_name), what=f"read {batch.object_name}")
        except nats.js.errors.NotFoundError as exc:  # ObjectNotFoundError and ObjectDeletedError included
            raise InvalidMessage(f"{batch.object_name}: the blob of batch {index} is gone (pruned once two "
                                 "checkpoints covered it, or past its 7 days)") from exc
        batch = _decode(result.data, batch.object_name)
    if batch.index != index:
        raise InvalidMessage(f"index: batch under {batch_subject(index)} says {batch.index}")
    return batch


async def wait_batch(bus: Bus, index: int, stop: asyncio.Event, *, poll: float = 1.0) -> data_pb2.TrainingBatch | None:
    """Batch `index` once it is published (woken by the publish, polling every `poll` s); None when stopped."""
    arrived = asyncio.Event()

    async def wake(_msg) -> None:
        arrived.set()

    sub = None
    try:
        sub = await bus.nc.subscribe(batch_subject(index), cb=wake)
    except Exception:  # noqa: BLE001 - without the wake-up we still poll
        sub = None
    try:
        while not stop.is_set():
            batch = await read_batch(bus, index)
            if batch is not None:
                return batch
            arrived.clear()
            waiters = [asyncio.ensure_future(arrived.wait()), asyncio.ensure_future(stop.wait())]
            await asyncio.wait(waiters, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
        return None
    finally:
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass


async def published_batches(bus: Bus) -> list[PublishedBatch]:
    """Every batch the stream holds, by index (the builder's record of what it has batched)."""
    info = await retry(lambda: bus.js.stream_info(STREAM), what="stream BATCHES")
    out: dict[int, PublishedBatch] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        async def get(seq=seq):
            try:
                return await bus.js.get_msg(STREAM, seq)
            except nats.js.errors.NotFoundError:
                return None

        raw = await retry(get, what=f"BATCHES seq {seq}")
        if raw is None or not raw.data:
            continue
        try:
            batch = _decode(raw.data, f"BATCHES seq {seq}")
        except InvalidMessage:
            continue
        out[batch.index] = PublishedBatch(batch.index, tuple(batch.group_ids),
                                          tuple(t.trajectory_id for t in batch.trajectories))
    return [out[i] for i in sorted(out)]


async def prune_blobs(bus: Bus, below: int) -> int:
    """Delete the out-of-band blobs of batches with an index under `below` (no trainer reads them again);
    returns how many went."""
    store = await _blobs(bus)
    try:
        names = [o.name for o in await retry(lambda: store.list(ignore_deletes=True), what=f"list {BLOBS}")]
    except nats.js.errors.NotFoundError:  # an empty store
        return 0
    gone = 0
    for name in names:
        index = blob_index(name)
        if index is not None and index < below:
            await retry(functools.partial(store.delete, name), what=f"delete {name}")
            gone += 1
    return gone


def blob_index(name: str) -> int | None:
    """The batch index of a blob named by `blob_name` (None for any other name)."""
    parts = name.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "batch" and parts[1].isdigit() else None


def _decode(data: bytes, what: str) -> data_pb2.TrainingBatch:
    try:
        return data_pb2.TrainingBatch.FromString(data)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise InvalidMessage(f"{what}: undecodable TrainingBatch: {exc}") from exc


async def _blobs(bus: Bus):
    async def open_store():
        try:
            return await bus.js.object_store(BLOBS)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            config = ObjectStoreConfig(bucket=BLOBS, replicas=bus.replicas, ttl=7 * 86400.0,
                                       max_bytes=bus.share_bytes(BLOBS_SHARE))
            try:
                return await bus.js.create_object_store(BLOBS, config=config)
            except nats.js.errors.APIError as exc:
                raise bus.storage_refused(exc, f"object store {BLOBS}", config.max_bytes) from exc

    return await retry(open_store, what="object store BATCH_BLOBS")

