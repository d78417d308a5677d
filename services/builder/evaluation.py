"""Held-out evaluation rounds: which versions to evaluate and the accuracy of each round. No I/O."""

from __future__ import annotations

import dataclasses

from services.common.errors import FieldError


@dataclasses.dataclass
class EvalRound:
    round_id: int
    version: int          # trainer version when the round was issued
    expected: int
    final: bool = False
    done: bool = False    # its result was published (a restarted builder knows it from the event alone)
    rewards: dict[str, float] = dataclasses.field(default_factory=dict)
    token_versions: set[int] = dataclasses.field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.done or len(self.rewards) >= self.expected

    @property
    def accuracy(self) -> float:
        return sum(1.0 for r in self.rewards.values() if r > 0) / max(1, len(self.rewards))


class EvalTracker:
    def __init__(self, every: int) -> None:
        if every < 0:
            raise FieldError("eval_every", f"must be >= 0, got {every}")
        self.every = every
        self.rounds: dict[int, EvalRound] = {}
        self._evaluated: set[int] = set()
        self._closed: set[int] = set()

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0 and version not in self._evaluated

    def start(self, version: int, expected: int, *, final: bool = False) -> EvalRound:
        return self.restore(len(self.rounds), version, expected, final=final)

    def restore(self, round_id: int, version: int, expected: int, *, final: bool = False) -> EvalRound:
        """A round issued earlier (by this process or one before a restart)."""
        self._evaluated.add(version)
        rnd = self.rounds.get(round_id)
        if rnd is None:
            rnd = self.rounds[round_id] = EvalRound(round_id, version, expected, final=final,
                                                    done=round_id in self._closed)
        return rnd

    def close(self, round_id: int) -> None:
        """The round's result is published (maybe known before the round itself): later results are ignored."""
        self._closed.add(round_id)
        if round_id in self.rounds:
            self.rounds[round_id].done = True

    def record(self, round_id: int, task_id: str, reward: float, versions: list[int]) -> EvalRound | None:
        """Returns the round when this result completed it; a repeated task result is ignored."""
        rnd = self.rounds.get(round_id)
        if rnd is None or rnd.complete or task_id in rnd.rewards:
            return None
        rnd.rewards[task_id] = reward
        rnd.token_versions.update(v for v in versions if v >= 0)
        return rnd if rnd.complete else None

    def expire(self, round_id: int) -> EvalRound | None:
        """A round whose missing results will never come (lost items): they count as wrong, and the round is
        complete now (returned; None when it was complete already)."""
        rnd = self.rounds.get(round_id)
        if rnd is None or rnd.complete:
            return None
        for k in range(rnd.expected - len(rnd.rewards)):
            rnd.rewards[f"missing-{k}"] = 0.0
        return rnd

    @property
    def pending(self) -> bool:
        return any(not r.complete for r in self.rounds.values())
