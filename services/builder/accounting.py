"""What a builder counts, rebuilt from what survives it (pure: no I/O).

A restarted builder reads the ledger (issued prompts, dropped groups, refills) and the batches published; from
them `recount` derives every counter the builder reports and its staleness budget restarts from, so the arithmetic
of recovery lives here, tested directly, and `Builder.recover` only reads and applies it. `RunEnd` is when the
run's last event may go out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from services.builder.admission import OnlineBudget, StalenessBudget
from services.builder.evaluation import EvalRound
from services.builder.ledger import NO_VARIANCE, Batched, LedgerState


@dataclasses.dataclass(frozen=True)
class Recount:
    batches_published: int        # the index after the highest published (never a count: BATCHES loses its oldest)
    consumed_groups: frozenset[str]  # batched or dropped: a member arriving again is acked as a duplicate
    received: int                 # trajectories batched or dropped
    dropped_stale: int            # trajectories dropped, except the groups dynamic sampling filtered
    groups_dropped: int           # groups dropped, except filtered ones
    batched_groups: int
    dropped_workflow: int         # dropped groups the builder issued itself (the rest came through the gateway)
    filtered: int                 # groups filtered for no reward variance
    refills: int                  # prompts issued in the place of filtered groups (at most one per filtered group)
    issued: int                   # prompt works counted as issued
    dropped_online: int           # dropped gateway groups

    def in_flight(self) -> int:
        """Issued groups neither batched nor dropped: their trajectories come back by redelivery."""
        return max(0, self.issued - self.batched_groups - self.dropped_workflow)

    def open_groups(self) -> list[str]:
        """The ids of the issued train groups still in flight (`g-<n>`, as `Builder` names them)."""
        return [f"g-{n}" for n in range(self.issued) if f"g-{n}" not in self.consumed_groups]

    def restore(self, budget: StalenessBudget) -> None:
        """The staleness budget as it stood (its version comes from the replayed events)."""
        budget.accepted = self.batched_groups
        budget.dropped = self.dropped_workflow
        budget.filtered, budget.refills = self.filtered, self.refills
        budget.in_flight = self.in_flight()

    def restore_online(self, budget: OnlineBudget) -> None:
        budget.released = self.dropped_online
        budget.arrived = self.batched_groups + self.dropped_workflow + self.dropped_online


def recount(ledger: LedgerState, batches: Iterable[Batched]) -> Recount:
    batches = list(batches)
    dropped = list(ledger.dropped.values())
    filtered = [d for d in dropped if d.reason == NO_VARIANCE]
    dropped_workflow = sum(1 for d in dropped if d.source == "workflow")
    return Recount(
        batches_published=max((b.index for b in batches), default=-1) + 1,
        consumed_groups=frozenset({g for b in batches for g in b.group_ids} | set(ledger.dropped)),
        received=sum(b.trajectories for b in batches) + sum(d.trajectories for d in dropped),
        dropped_stale=sum(d.trajectories for d in dropped) - sum(d.trajectories for d in filtered),
        groups_dropped=len(dropped) - len(filtered),
        batched_groups=sum(len(b.group_ids) for b in batches),
        dropped_workflow=dropped_workflow,
        filtered=len(filtered),
        refills=min(ledger.refills, len(filtered)),
        issued=ledger.issued,
        dropped_online=len(dropped) - dropped_workflow)


@dataclasses.dataclass
class RunEnd:
    """How a run ends: the final eval round is issued once; RUN_END is asked for once that round completes (or an
    online run reaches its steps) and goes out once the trainer's final checkpoint is seen, or
    ``checkpoint_timeout_s`` after asking (a final/ still being written would be cut off by the stack's stop)."""

    checkpoint_timeout_s: float
    final_round: EvalRound | None = None
    seen: bool = False                 # a RUN_END is on the stream (this builder's, or a predecessor's)
    checkpointed: bool = False         # the trainer's CHECKPOINT event for final/ was seen
    asked: tuple[int, dict[str, float], float] | None = None  # (version, metrics, when): RUN_END asked, not yet out

    def ask(self, version: int, metrics: dict[str, float], at: float) -> None:
        if self.asked is None:
            self.asked = (version, metrics, at)

    def due(self, at: float) -> tuple[int, dict[str, float], bool] | None:
        """(version, metrics, whether the final checkpoint was seen) when RUN_END should go out now; else None."""
        if self.asked is None or self.seen:
            return None
        version, metrics, asked = self.asked
        if not self.checkpointed and at - asked < self.checkpoint_timeout_s:
            return None
        return version, metrics, self.checkpointed

    def waited(self, at: float) -> float:
        return at - self.asked[2] if self.asked is not None else 0.0

    def interrupted(self) -> bool:
        """The final round completed but no RUN_END followed (the crash came between the two events)."""
        return self.final_round is not None and self.final_round.complete and not self.seen
