"""A trainer as a group of ranks: rank 0 (the service: gRPC, bus, weight sync, checkpoints) sends every collective
call to the other ranks before making it itself; they follow in a loop. Commands travel by
``broadcast_object_list`` on a gloo group of their own, with the group's timeout; while idle, rank 0 sends a
heartbeat, so a rank that died (or a rank 0 that died) ends the group with an error instead of a hang."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

from services.common.logging import get_logger
from services.trainer.backends.base import TrainerBackend

COLLECTIVE = ("step", "state", "restore", "gather_weights")  # every rank takes part; the rest on rank 0 alone


def control_group(timeout: float) -> dist.ProcessGroup:
    """A gloo group for the commands (also when the model's collectives run on NCCL / HCCL)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))


def heartbeat_seconds(timeout: float) -> float:
    return min(10.0, timeout / 4)


class Leader:
    """Rank 0's backend: collective calls are sent to the followers first; everything else passes through."""

    def __init__(self, backend: TrainerBackend, timeout: float) -> None:
        assert backend.rank == 0 and backend.world > 1
        self.backend = backend
        self.group = control_group(timeout)
        self.interval = heartbeat_seconds(timeout)
        self.lock = threading.Lock()  # one command at a time, its local part included
        self.last_sent = time.monotonic()
        self.stopped = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.backend, name)
        if name not in COLLECTIVE:
            return attr

        def collective(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self._send((name, args, kwargs))
                out = attr(*args, **kwargs)
                if name == "step":  # every rank's shard holds the new version (and says so) before a sync
                    dist.barrier(group=self.group)
                return out

        return collective

    def _send(self, command: tuple) -> None:
        if self.stopped:
            raise RuntimeError("trainer ranks: the group was stopped")
        try:
            dist.broadcast_object_list([command], src=0, group=self.group)
        except Exception as exc:
            raise RuntimeError(f"trainer ranks: a rank of {self.backend.world} is gone ({exc!r}); "
                               "the group stops (its supervisor restarts it)") from exc
        self.last_sent = time.monotonic()

    def heartbeat(self) -> None:
        """Send a heartbeat when no command went out for a while (call from a worker thread, periodically)."""
        if time.monotonic() - self.last_sent < self.interval or not self.lock.acquire(blocking=False):
            return
        try:
            self._send(("ping", (), {}))
        finally:
            self.lock.release()

    def stop(self) -> None:
        """Tell the followers to exit; best effort (they end on their own when this rank is gone)."""
        with self.lock:
            if not self.stopped:
                try:
                    self._send(("stop", (), {}))
                except RuntimeError as exc:
                    get_logger().warning("trainer_ranks_stop_failed", error=str(exc))
                self.stopped = True
        self.backend.close()


def follow(backend: TrainerBackend, timeout: float, stop: threading.Event | None = None, sender=None) -> None:
    """A rank > 0: take each command from rank 0 until it says stop (or ``stop`` is set between commands).
    ``sender``: this rank's weight-sync sender of its own shards, bracketed around each step."""
    group = control_group(timeout)
    log = get_logger().bind(rank=backend.rank)
    log.info("following", world=backend.world)
    try:
        while stop is None or not stop.is_set():
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0, group=group)
            except Exception as exc:
                raise RuntimeError(f"trainer rank {backend.rank}: rank 0 is gone or silent for {timeout}s "
                                   f"({exc!r})") from exc
            name, args, kwargs = box[0]
            if name == "stop":
                log.info("stopped_by_rank_0")
                return
            if name == "ping":
                continue
            try:
                if name == "step" and sender is not None:
                    sender.begin_update()
                getattr(backend, name)(*args, **kwargs)
                if name == "step":
                    if sender is not None:
                        sender.end_update(kwargs.get("version", args[1] if len(args) > 1 else 0) + 1)
                    dist.barrier(group=group)
            except (RuntimeError, dist.DistError) as exc:  # a collective inside the call lost a rank
                raise RuntimeError(f"trainer rank {backend.rank}: the group failed during {name} ({exc!r})") from exc
    finally:
        backend.close()
