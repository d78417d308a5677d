"""One traj.scored message holding several groups (the reward service's bundle of a rollout's groups): each group
holds a part of its ack, and the message is acked once every part is. A group retired before the others is then
not redelivered alone; until the last part, a crash redelivers the whole message, and the groups already batched
or dropped are acked again as duplicates."""

from __future__ import annotations

from typing import Any


class SharedAck:
    def __init__(self, msg: Any, parts: int) -> None:
        assert parts >= 1
        self.msg = msg
        self.left = parts

    def part(self) -> AckPart:
        return AckPart(self)

    async def _part_acked(self) -> None:
        self.left -= 1
        assert self.left >= 0
        if self.left == 0:
            await self.msg.ack()


class AckPart:
    """What a group holds in place of the message: `ack` counts once however often it is called (an eval
    round's results each hold it); `in_progress` extends the whole message's deadline."""

    def __init__(self, shared: SharedAck) -> None:
        self.shared = shared
        self.acked = False

    async def ack(self) -> None:
        if not self.acked:
            self.acked = True
            await self.shared._part_acked()

    async def in_progress(self) -> None:
        await self.shared.msg.in_progress()
