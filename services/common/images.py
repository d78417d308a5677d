"""Dataset images by reference: the IMAGES object store, each object named by the SHA-256 of its encoded bytes.

The builder puts a task's images once and names them in its work (``PromptWork.images``); the rollout copies the
names onto the trajectories, and the rollout and trainer fetch the bytes by name when they need pixels. Messages
carry 72 bytes per image instead of the image, and a picture sampled in many groups is stored once. Reads are
verified against the name (a corrupt or substituted object is refused) and kept in a small in-process cache.
"""

from __future__ import annotations

import collections
import hashlib
import re

import nats.js.errors
from nats.js.api import ObjectStoreConfig

from services.common.bus import IMAGES_SHARE, Bus, InvalidMessage, retry
from services.common.contracts import data_pb2
from services.common.image_data import MAX_IMAGE_BYTES

BUCKET = "IMAGES"
SHA256 = re.compile(r"[0-9a-f]{64}")


def ref_of(blob: bytes) -> data_pb2.ImageRef:
    return data_pb2.ImageRef(sha256=hashlib.sha256(blob).hexdigest(), size=len(blob))


def check_refs(refs, field: str = "images") -> None:
    """InvalidMessage naming the field unless every reference is well formed."""
    for i, ref in enumerate(refs):
        if not SHA256.fullmatch(ref.sha256):
            raise InvalidMessage(f"{field}[{i}].sha256: must be 64 lowercase hex digits")
        if not 0 < ref.size <= MAX_IMAGE_BYTES:
            raise InvalidMessage(f"{field}[{i}].size: must be in [1, {MAX_IMAGE_BYTES}], got {ref.size}")


class ImageStore:
    """Put and get images by digest over one bus connection. ``cache`` bytes of recently read images are kept."""

    def __init__(self, bus: Bus, *, cache_bytes: int = 64 << 20) -> None:
        self.bus = bus
        self.cache_bytes = cache_bytes
        self._store = None
        self._stored: set[str] = set()  # put (or found) by this process
        self._cache: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._cached = 0

    async def _open(self):
        if self._store is None:
            self._store = await retry(self._open_or_create, what=f"object store {BUCKET}")
        return self._store

    async def _open_or_create(self):
        try:
            return await self.bus.js.object_store(BUCKET)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
            config = ObjectStoreConfig(bucket=BUCKET, replicas=self.bus.replicas, max_bytes=self.bus.share_bytes(IMAGES_SHARE))
            try:
                return await self.bus.js.create_object_store(BUCKET, config=config)
            except nats.js.errors.APIError as exc:
                raise self.bus.storage_refused(exc, f"object store {BUCKET}", config.max_bytes) from exc

    async def put(self, blob: bytes) -> data_pb2.ImageRef:
        """Store ``blob`` (once: an image already there is not written again) and return its reference."""
        if not 0 < len(blob) <= MAX_IMAGE_BYTES:
            raise ValueError(f"images: an image must be 1 to {MAX_IMAGE_BYTES} bytes, got {len(blob)}")
        ref = ref_of(blob)
        if ref.sha256 in self._stored:
            return ref
        store = await self._open()
        try:
            await store.get_info(ref.sha256)
        except nats.js.errors.ObjectNotFoundError:
            await retry(lambda: store.put(ref.sha256, blob), what=f"put image {ref.sha256[:12]}")
        self._stored.add(ref.sha256)
        return ref

    async def get(self, ref: data_pb2.ImageRef) -> bytes:
        """The image's bytes; InvalidMessage when the store has no such image or holds other bytes under its name
        (the work or trajectory naming it can never be used)."""
        blob = self._cache.get(ref.sha256)
        if blob is not None:
            self._cache.move_to_end(ref.sha256)
            return blob
        store = await self._open()
        try:
            result = await retry(lambda: store.get(ref.sha256), what=f"get image {ref.sha256[:12]}")
        except nats.js.errors.ObjectNotFoundError as exc:
            raise InvalidMessage(f"images: no image {ref.sha256} in the {BUCKET} object store") from exc
        blob = result.data or b""
        if hashlib.sha256(blob).hexdigest() != ref.sha256:
            raise InvalidMessage(f"images: the {BUCKET} object {ref.sha256} does not hash to its name")
        self._remember(ref.sha256, blob)
        return blob

    async def get_all(self, refs) -> list[bytes]:
        return [await self.get(ref) for ref in refs]

    def _remember(self, digest: str, blob: bytes) -> None:
        self._cache[digest] = blob
        self._cached += len(blob)
        while self._cached > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
