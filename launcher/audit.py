"""The run's invariant, read back from the data plane and the final checkpoint after a run.

Whatever was killed and restarted: the run completed; the final policy's lineage applies batch indices
0..N-1 each exactly once; no trajectory id is in two trained batches; every admitted group is trained or
dropped with a reason; no trained token is more than eta versions older than the batch that trained it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib

from services.builder.ledger import Ledger
from services.common.batches import read_batch
from services.common.bus import Bus


@dataclasses.dataclass
class Audit:
    completed: bool
    total_steps: int
    eta: int
    batch_indices_trained: list[int]
    skipped_indices: list[int]
    duplicate_trajectories_trained: int
    groups_admitted: int
    groups_trained: int
    groups_dropped: dict[str, int]
    dlq_messages: dict[str, int]
    max_staleness_trained: int

    @property
    def groups_lost(self) -> int:
        return self.groups_admitted - self.groups_trained - sum(self.groups_dropped.values())

    def violations(self) -> list[str]:
        out = []
        if not self.completed:
            out.append("the run did not complete")
        lineage = self.batch_indices_trained + self.skipped_indices
        if sorted(lineage) != list(range(self.total_steps)):
            out.append(f"lineage is not 0..{self.total_steps - 1} once each: trained {self.batch_indices_trained}, "
                       f"skipped {self.skipped_indices}")
        if self.duplicate_trajectories_trained:
            out.append(f"{self.duplicate_trajectories_trained} trajectories trained twice")
        if self.groups_lost:
            out.append(f"{self.groups_lost} admitted groups neither trained nor dropped")
        if self.max_staleness_trained > self.eta:
            out.append(f"max staleness trained {self.max_staleness_trained} > eta {self.eta}")
        return out

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "groups_lost": self.groups_lost}


def read_lineage(run_dir: pathlib.Path) -> dict:
    path = run_dir / "final" / "meshrl_lineage.json"
    if not path.exists():
        return {"batch_indices": [], "skipped": []}
    return json.loads(path.read_text())


async def audit_run(nats_url: str, run_dir: pathlib.Path, *, completed: bool, total_steps: int, eta: int,
                    online: bool = False, nats_options: dict | None = None) -> Audit:
    """`nats_options`: credentials for Bus.connect (a launched stack's `bus_options`: the operator's)."""
    bus = await Bus.connect(nats_url, name="audit", deadline=60.0, declare=False, **(nats_options or {}))
    try:
        lineage = read_lineage(run_dir)
        indices = [int(i) for i in lineage.get("batch_indices", [])]
        seen: collections.Counter[str] = collections.Counter()
        groups = 0
        max_staleness = 0
        for index in indices:
            batch = await read_batch(bus, index)
            if batch is None:
                continue
            groups += len(batch.group_ids)
            for traj in batch.trajectories:
                seen[traj.trajectory_id] += 1
                versions = [v for v in traj.versions if v >= 0]
                if versions:
                    max_staleness = max(max_staleness, index - min(versions))
        ledger_state = await _ledger(bus)
        dropped = collections.Counter(d.reason for d in ledger_state.dropped.values())
        admitted = groups + sum(dropped.values()) if online else ledger_state.issued
        return Audit(completed=completed, total_steps=total_steps, eta=eta, batch_indices_trained=indices,
                     skipped_indices=[int(i) for i in lineage.get("skipped", [])],
                     duplicate_trajectories_trained=sum(n - 1 for n in seen.values() if n > 1),
                     groups_admitted=admitted, groups_trained=groups, groups_dropped=dict(dropped),
                     dlq_messages=await bus.dead_letter_counts(), max_staleness_trained=max_staleness)
    finally:
        await bus.close()


async def _ledger(bus: Bus):
    ledger = Ledger(bus)
    await ledger.open()
    return await ledger.load()
