"""The builder's durable records in a JetStream key-value bucket, so a builder restarted anywhere (another
node, another pod) continues where the last one stopped.

Keys: `issued` (train groups issued so far, group n being `g-<n>`, the n-th task of the seeded train stream; how
many of them were refills, issued in the place of a group dynamic sampling filtered; and where the last chunk of
issues began: written before the chunk's works are published, so a restarted builder publishes that chunk again),
`drops.<id>` (groups that will never be trained, with their reasons: the drops that came while the previous record
was being written go into one record, a group commit), `eval.<round_id>` (an eval round that was issued),
`batch.<index>` (a batch published: its groups and trajectory count). Older builders wrote `refills` and
`dropped.<group_id>` (one group each), still read. BATCHES also holds the
batches, but under limits (age, bytes) it loses the oldest, so it only fills in the ledger (a batch published
just before a crash, before its record); versions come from replaying EVENTS.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import nats.js.errors
from nats.js.api import KeyValueConfig

from services.common.bus import LEDGER_SHARE, Bus, retry
from services.common.group_commit import GroupCommit

BUCKET = "meshrl_builder"
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
    chunk_start: int = 0   # the first group of the last chunk counted as issued (published, or maybe not)
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
        self._drops = GroupCommit(self._write_drops, name="ledger-drops")

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
            if key == "issued" and isinstance(record, dict):
                state.issued, state.chunk_start = int(record["issued"]), int(record["chunk_start"])
                state.refills = max(state.refills, int(record["refills"]))
            elif key == "issued":    # an older builder's: the count alone, its last group the chunk
                state.issued = int(record)
                state.chunk_start = max(0, state.issued - 1)
            elif key == "refills":
                state.refills = max(state.refills, int(record))
            elif key.startswith("drops."):
                state.dropped.update((d["group_id"], Dropped(**d)) for d in record)
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

    async def set_issued(self, n: int, refills: int, chunk_start: int | None = None) -> None:
        """`n` groups issued, `refills` of them refills; `chunk_start` (default: the last one) is where the
        chunk whose works are about to be published begins."""
        start = max(0, n - 1) if chunk_start is None else chunk_start
        assert 0 <= start <= n, (start, n)
        await self._put("issued", {"issued": n, "refills": refills, "chunk_start": start})

    async def add_dropped(self, dropped: Dropped) -> None:
        """Returns once the drop is durable. Drops that come while a record is being written wait for it and
        go together into the next one: one write per burst of filtered groups instead of one per group."""
        await self._drops.add(dropped)

    async def _write_drops(self, drops: list[Dropped]) -> None:
        await self._put(f"drops.{uuid.uuid4().hex}", [dataclasses.asdict(d) for d in drops])

    async def add_batch(self, batch: Batched) -> None:
        await self._put(f"batch.{batch.index}", dataclasses.asdict(batch))

    async def add_eval(self, rnd: IssuedEval) -> None:
        await self._put(f"eval.{rnd.round_id}", dataclasses.asdict(rnd))

    async def _put(self, key: str, value) -> None:
        data = json.dumps(value).encode()
        await retry(lambda: self.kv.put(key, data), what=f"ledger {key}")
