"""The staleness budget for agent groups, as the builder announces it (pure, no I/O).

A group (the sessions of one /rl/start_session) is admitted when the first model request of any of its
sessions arrives; later requests of an admitted group never wait for the budget. Capacity =
limit + released - max(admitted, arrived): `limit` = (version + eta + 1) * batch_size, `released` = online
groups the builder dropped stale, `arrived` = online groups the builder received (all from the builder's
budget events). Announced values only grow (a restarted builder cannot shrink the budget under admitted
groups). A group that will never reach a batch (fewer of its sessions exported the group's trajectory than
its size, e.g. all ended without a model call) frees its slot; groups a session exports besides its own
(branches, "interaction" export) count as admitted when it ends. Before any announcement: unlimited.
"""

from __future__ import annotations

import dataclasses

from services.common.errors import FieldError


@dataclasses.dataclass
class _Group:
    size: int
    admitted: bool = False
    ended: int = 0
    exported: int = 0   # sessions that exported the group's own trajectory


class GroupBudget:
    def __init__(self) -> None:
        self.limit: int | None = None   # None: no announcement yet (dataset mode): unlimited
        self.released = 0
        self.arrived = 0
        self.admitted = 0
        self._groups: dict[str, _Group] = {}

    def update(self, *, limit: int, released: int = 0, arrived: int = 0) -> None:
        for name, value in (("limit", limit), ("released", released), ("arrived", arrived)):
            if value < 0:
                raise FieldError(name, f"must be >= 0, got {value}")
        self.limit = limit if self.limit is None else max(self.limit, limit)
        self.released = max(self.released, released)
        self.arrived = max(self.arrived, arrived)

    def capacity(self) -> int | None:
        """Groups that may still be admitted (may be negative); None: unlimited."""
        if self.limit is None:
            return None
        return self.limit + self.released - max(self.admitted, self.arrived)

    def is_admitted(self, group_id: str) -> bool:
        group = self._groups.get(group_id)
        return group is not None and group.admitted

    def admit(self, group_id: str, size: int) -> bool:
        """True when the group is (or now becomes) admitted."""
        if self.is_admitted(group_id):
            return True
        capacity = self.capacity()
        if capacity is not None and capacity <= 0:
            return False
        self._groups.setdefault(group_id, _Group(size)).admitted = True
        self.admitted += 1
        return True

    def end(self, group_id: str, size: int, *, exported: bool, extra: int = 0) -> None:
        """A session of the group ended; `exported`: it exported the group's trajectory; `extra`: other groups."""
        self.admitted += extra
        group = self._groups.setdefault(group_id, _Group(size))
        group.ended += 1
        group.exported += int(exported)
        if group.ended < group.size:
            return
        del self._groups[group_id]
        if group.admitted and group.exported < group.size:
            self.admitted -= 1  # the builder never gets the whole group: it will not train on it

    def snapshot(self) -> dict:
        return {"limit": self.limit, "released": self.released, "arrived": self.arrived, "admitted": self.admitted,
                "capacity": self.capacity()}
