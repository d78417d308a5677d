"""The staleness budget: admit prompt work only while accepted + in_flight <= (version + eta + 1) * batch_size;
with source: online, the same limit is announced to the gateway (OnlineBudget).

Counts are in groups (one prompt work = one group of samples). A group that is dropped (stale or
failed) releases its slot. eta = 0 is synchronous RL. Pure state, no I/O.

Dynamic sampling (DAPO) refills through the same slots: a complete group whose rewards are all equal is
filtered (`on_filtered`) and its slot goes to an extra prompt, so a batch keeps batch_size informative groups
and the in-flight work never exceeds the budget. `refills` counts the extra prompts issued.
"""

from __future__ import annotations

import dataclasses

from services.common.contracts import data_pb2
from services.common.errors import FieldError


@dataclasses.dataclass
class _Window:
    """(version + eta + 1) * batch_size groups: what may exist before the batch at `version` + eta is formed."""
    batch_size: int
    max_staleness: int
    version: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise FieldError("batch_size", f"must be >= 1, got {self.batch_size}")
        if self.max_staleness < 0:
            raise FieldError("max_staleness", f"must be >= 0, got {self.max_staleness}")

    @property
    def limit(self) -> int:
        return (self.version + self.max_staleness + 1) * self.batch_size

    def on_version(self, version: int) -> None:
        self.version = max(self.version, version)


@dataclasses.dataclass
class StalenessBudget(_Window):
    accepted: int = 0
    in_flight: int = 0
    dropped: int = 0
    filtered: int = 0   # complete groups without reward variance (dynamic sampling), counted in `dropped` too
    refills: int = 0    # prompts issued in the place of filtered groups

    def capacity(self) -> int:
        return max(0, self.limit - (self.accepted + self.in_flight))

    def try_issue(self) -> bool:
        if self.capacity() <= 0:
            return False
        self.in_flight += 1
        if self.refills < self.filtered:
            self.refills += 1
        assert self.accepted + self.in_flight <= self.limit
        return True

    def cancel_issue(self, *, refilled: bool) -> None:
        """`try_issue` granted a slot but the prompt was not published: give it back."""
        assert self.in_flight > 0
        self.in_flight -= 1
        if refilled:
            self.refills -= 1

    def on_complete(self, *, accepted: bool) -> None:
        assert self.in_flight > 0, "completion without an issued group"
        self.in_flight -= 1
        if accepted:
            self.accepted += 1
        else:
            self.dropped += 1

    def on_unaccept(self) -> None:
        """A group that was accepted got dropped later (stale at batch time): release its slot."""
        assert self.accepted > 0
        self.accepted -= 1
        self.dropped += 1

    def on_filtered(self) -> None:
        """An accepted group has no reward variance (dynamic sampling): its slot goes to an extra prompt."""
        self.on_unaccept()
        self.filtered += 1


@dataclasses.dataclass
class OnlineBudget(_Window):
    """The budget the builder announces to the gateway (source: online), in groups.

    `version` is the *deployed* one: a group the gateway admits now samples at the weights the rollout
    serves, which lag the trainer's by a sync. `released` counts online groups dropped stale (each frees a
    slot), `arrived` the online groups received whole. Every announcement has its own event id (the bus
    dedupe key).
    """

    released: int = 0
    arrived: int = 0

    @property
    def event_id(self) -> str:
        return f"budget-{self.version}-{self.released}"

    def to_proto(self) -> data_pb2.OnlineBudget:
        return data_pb2.OnlineBudget(limit_groups=self.limit, released_groups=self.released,
                                     arrived_groups=self.arrived, eta=self.max_staleness, batch_size=self.batch_size)

    def metrics(self) -> dict[str, float]:
        return {"limit_groups": float(self.limit), "released_groups": float(self.released),
                "arrived_groups": float(self.arrived), "eta": float(self.max_staleness),
                "batch_size": float(self.batch_size)}
