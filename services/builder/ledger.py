"""The builder's durable records in a JetStream key-value bucket, so a builder restarted anywhere (another
node, another pod) continues where the last one stopped.

Keys: `issued` (train groups issued so far; group n is `g-<n>`, the n-th task of the seeded train stream;
written before the work is published, so a restarted builder publishes the last one again),
`refills` (how many of them were issued in the place of a group dynamic sampling filtered),
`dropped.<group_id>` (a group that will never be trained, with its reason), `eval.<round_id>` (an eval round
that was issued), `batch.<index>` (a batch published: its groups and trajectory count). BATCHES also holds the
batches, but under limits (age, bytes) it loses the oldest, so it only fills in the ledger (a batch published
just before a crash, before its record); versions come from replaying EVENTS.
"""

from __future__ import annotations

import dataclasses
import json
import re

import nats.js.errors
from nats.js.api import KeyValueConfig

from services.common.bus import LEDGER_SHARE, Bus, retry

BUCKET = "meshrl_builder"
_KEY_UNSAFE = re.compile(r"[^-/_=a-zA-Z0-9]")  # the value keeps the exact group id
NO_VARIANCE = "no_reward_variance"  # the reason of a group dynamic sampling filtered


@dataclasses.dataclass(frozen=True)
class Dropped:
    group_id: str
    reason: str       # "stale", "dead_letter:<consumer>", NO_VARIANCE
    source: str       # "workflow" or "gateway"
    trajectories: int


@dataclasses.dataclass(frozen=True)
class IssuedEval:
    round_id: int
    version: int
    expected: int
    final: bool


@dataclasses.dataclass(frozen=True)
class Batched:
    index: int
    group_ids: tuple[str, ...]
    trajectories: int


@dataclasses.dataclass
class LedgerState:
    issued: int = 0
    refills: int = 0
    dropped: dict[str, Dropped] = dataclasses.field(default_factory=dict)
    evals: dict[int, IssuedEval] = dataclasses.field(default_factory=dict)
    batches: dict[int, Batched] = dataclasses.field(default_factory=dict)


def merge_batches(recorded: dict[int, Batched], published) -> dict[int, Batched]:
    """The ledger's batch records with those the stream still holds (`PublishedBatch`es): every index either
    knows, in any order and with any gaps (the stream drops its oldest, the ledger lacks the newest after a
    crash between the publish and the record)."""
    merged = {b.index: Batched(b.index, tuple(b.group_ids), len(b.trajectory_ids)) for b in published}
    merged.update(recorded)  # a record counts the trajectories of a batch stored out of band too
    return merged


class Ledger:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.kv = None

    async def open(self) -> None:
        async def open_kv():
            try:
                return await self.bus.js.key_value(BUCKET)
            except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
                config = KeyValueConfig(bucket=BUCKET, history=1, replicas=self.bus.replicas,
                                        max_bytes=self.bus.share_bytes(LEDGER_SHARE))
                try:
                    return await self.bus.js.create_key_value(config)
                except nats.js.errors.APIError as exc:
                    raise self.bus.storage_refused(exc, f"key-value bucket {BUCKET}", config.max_bytes) from exc

        self.kv = await retry(open_kv, what=f"key-value bucket {BUCKET}")

    async def load(self) -> LedgerState:
        state = LedgerState()
        for key in await retry(self._keys, what="ledger keys"):
            value = await retry(lambda key=key: self.kv.get(key), what=f"ledger {key}")
            record = json.loads(value.value)
            if key == "issued":
                state.issued = int(record)
            elif key == "refills":
                state.refills = int(record)
            elif key.startswith("dropped."):
                state.dropped[record["group_id"]] = Dropped(**record)
            elif key.startswith("eval."):
                state.evals[record["round_id"]] = IssuedEval(**record)
            elif key.startswith("batch."):
                record["group_ids"] = tuple(record["group_ids"])
                state.batches[record["index"]] = Batched(**record)
        return state

    async def _keys(self) -> list[str]:
        prefix = f"$KV.{BUCKET}."
        return [s.removeprefix(prefix) for s in await self.bus.stream_subjects(f"KV_{BUCKET}", prefix + ">")]

    async def set_issued(self, n: int) -> None:
        await self._put("issued", n)

    async def set_refills(self, n: int) -> None:
        await self._put("refills", n)

    async def add_dropped(self, dropped: Dropped) -> None:
        await self._put("dropped." + _KEY_UNSAFE.sub("_", dropped.group_id), dataclasses.asdict(dropped))

    async def add_batch(self, batch: Batched) -> None:
        await self._put(f"batch.{batch.index}", dataclasses.asdict(batch))

    async def add_eval(self, rnd: IssuedEval) -> None:
        await self._put(f"eval.{rnd.round_id}", dataclasses.asdict(rnd))

    async def _put(self, key: str, value) -> None:
        data = json.dumps(value).encode()
        await retry(lambda: self.kv.put(key, data), what=f"ledger {key}")
