"""The trainer service's edges: reads training batches by index, publishes version events, syncs weights,
writes checkpoints, serves gRPC.

Batch i is trained at policy version i, read from the BATCHES stream by index (the stream keeps batches),
so a trainer restarted from its newest complete checkpoint (version v) reads batch v next and its
lineage applies every batch index exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib

import grpc
import prometheus_client
import torch

from services.common.batches import batch_subject, wait_batch
from services.common.bus import SUBJECT_VERSIONS, TRANSIENT, Bus, InvalidMessage, wait_either
from services.common.contracts import common_pb2, data_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.deadletters import DeadLetterWatch
from services.common.ids import now
from services.common.logging import get_logger
from services.common.rpc import Servicer, start_server
from services.common.service import supervise
from services.trainer.batching import distinct_versions, pack, trajectory_staleness
from services.trainer.checkpoint import latest_checkpoint, prune_checkpoints, read_lineage, remove_leftovers
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainerEngine

VERSION = prometheus_client.Gauge("meshrl_trainer_policy_version", "Trainer policy version")
STEP_METRICS = prometheus_client.Gauge("meshrl_trainer_step_metric", "Last step metrics", ["name"])
STALENESS = prometheus_client.Histogram("meshrl_trainer_staleness", "Trajectory staleness when trained",
                                        buckets=(0, 1, 2, 3, 4, 6, 8, 16))
BATCH_STALENESS = prometheus_client.Gauge("meshrl_trainer_batch_staleness_trajectories",
                                          "Trajectories of the last batch by staleness (versions)", ["staleness"])
SKIPPED = prometheus_client.Counter("meshrl_trainer_batches_skipped", "Batches dead-lettered and skipped")
CHECKPOINT_ATTEMPTS = 3
COUNTERS = ("version", "trajectories_trained", "max_staleness", "max_versions", "sync_failures")  # resumed
NO_RETRY = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Trainer:
    def __init__(self, config: TrainerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        torch.manual_seed(config.seed)
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.engine = TrainerEngine(config)
        self.version = 0
        self.trajectories_trained = 0
        self.max_staleness = 0
        self.max_versions = 0
        self.last_metrics: dict[str, float] = {}
        self.lineage: dict[str, list] = {"batch_indices": [], "batch_ids": [], "skipped": []}
        self.resumed_from: pathlib.Path | None = None
        self.sender = None
        self.dead_letters = DeadLetterWatch(bus)
        self.sync_failures = 0
        self.running = asyncio.Event()
        self.running.set()
        self.lock = asyncio.Lock()  # a step and a checkpoint never overlap
        self.run_dir = pathlib.Path(config.run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.log = get_logger().bind(rank_id=config.rank_id)

    def resume(self) -> pathlib.Path | None:
        """Load the newest complete checkpoint in run_dir/checkpoints (incomplete ones are removed)."""
        prune_checkpoints(self.checkpoints, self.config.keep_checkpoints)
        remove_leftovers(self.run_dir, "final")
        path = latest_checkpoint(self.checkpoints)
        if path is None:
            self.log.info("fresh_start", version=self.version)
            return None
        t = self.engine.restore(path)["trainer"]
        for key in COUNTERS:
            setattr(self, key, t[key])
        self.lineage = {key: list(value) for key, value in t["lineage"].items()}
        self.resumed_from = path
        VERSION.set(self.version)
        self.log.info("resumed", resumed_from=str(path), version=self.version)
        return path

    async def run(self, stop: asyncio.Event) -> None:
        """Train batch `version`, then the next, until `stop`; waits while paused."""
        await self.finish_if_done()
        delay = 0.5
        while not stop.is_set():
            if not self.running.is_set():
                await wait_either(self.running, stop)
                continue
            index = self.version
            try:
                batch = await wait_batch(self.bus, index, stop)
            except InvalidMessage as exc:
                await self.skip(index, str(exc))
                continue
            except TRANSIENT as exc:  # NATS away longer than the bus's retries: keep waiting for it
                self.log.warning("batch_read_failed", index=index, retry_in=delay, error=repr(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(delay * 2, 10.0)
                continue
            delay = 0.5
            if batch is None:
                break
            if self.running.is_set():  # paused while waiting: read it again on resume
                await self.handle_batch(batch)

    async def handle_batch(self, batch: data_pb2.TrainingBatch) -> None:
        if batch.index != self.version:
            self.log.warning("batch_out_of_turn", index=batch.index, version=self.version)
            return
        try:
            packed = pack(list(batch.trajectories), self.engine.pad_token_id)
            self.engine.check_token_ids(packed)
        except ValueError as exc:
            await self.skip(batch.index, str(exc))
            return
        staleness = [trajectory_staleness(t, self.version) for t in batch.trajectories]
        started = now()
        async with self.lock:
            metrics = await asyncio.to_thread(self._step, packed, self.version)
            self.version += 1
            self.lineage["batch_indices"].append(batch.index)
            self.lineage["batch_ids"].append(batch.batch_id)
            self.trajectories_trained += len(batch.trajectories)
            self.max_staleness = max(self.max_staleness, *staleness)
            self.max_versions = max(self.max_versions, *(distinct_versions(t) for t in batch.trajectories))
        for s in staleness:
            STALENESS.observe(s)
        metrics.update(step_seconds=now() - started, staleness_max_batch=float(max(staleness)),
                       max_staleness_trained=float(self.max_staleness), trajectories_trained=self.trajectories_trained,
                       max_versions_in_one_trajectory=float(self.max_versions), dropped_stale=float(batch.dropped_stale),
                       batch_index=float(batch.index))
        await self.after_step(metrics)
        self.log.info("step", version=self.version, reward=round(metrics["reward_mean"], 3),
                      loss=round(metrics.get("loss", 0.0), 4), staleness=int(max(staleness)))

    def _step(self, packed, version: int) -> dict[str, float]:
        """In a worker thread: the step, bracketed for the weight-sync sender (no torn reads)."""
        if self.sender is not None:
            self.sender.begin_update()
        metrics = self.engine.step(packed, version)
        if self.sender is not None:
            self.sender.end_update(version + 1)
        return metrics

    async def skip(self, index: int, reason: str) -> None:
        """Dead-letter batch `index` and move past it: the version advances without an optimizer step."""
        await self.bus.dead_letter_data("trainer", batch_subject(index), b"", reason, key=str(index))
        self.log.warning("batch_skipped", index=index, reason=reason)
        SKIPPED.inc()
        async with self.lock:
            self.version += 1
            self.lineage["skipped"].append(index)
            if self.sender is not None:
                self.sender.end_update(self.version)
        await self.after_step({"skipped": 1.0, "batch_index": float(index),
                               "trajectories_trained": float(self.trajectories_trained)})

    async def after_step(self, metrics: dict[str, float]) -> None:
        """Announce, deploy and (when due) checkpoint the new version; each effect is retried."""
        self.last_metrics = metrics
        VERSION.set(self.version)
        BATCH_STALENESS.clear()  # the histogram's keys change from batch to batch
        for key, value in metrics.items():
            if key.startswith("staleness_hist_"):
                BATCH_STALENESS.labels(key.removeprefix("staleness_hist_")).set(value)
            else:
                STEP_METRICS.labels(key).set(value)
        # announce first: the builder admits the next work while the weights move, so generation
        # in flight is what the update interrupts. A resumed trainer may announce a version again (same id).
        event = data_pb2.VersionEvent(event_id=f"trained-{self.version}", version=self.version,
                                      kind=data_pb2.VERSION_KIND_TRAINED, at=now(), metrics=metrics)
        await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        await self.sync_weights(metrics)
        self._append_metrics(metrics)
        every = self.config.checkpoint_every
        if (every and self.version % every == 0) or self.version == self.config.total_steps:
            await self.checkpoint(required=False)
        await self.finish_if_done()

    async def finish_if_done(self) -> None:
        """The final checkpoint once `total_steps` are done (again after a restart that lost it)."""
        total = self.config.total_steps
        if not total or self.version != total:
            return
        final = read_lineage(self.run_dir / "final")
        if final is None or final.get("version") != self.version:
            await self.checkpoint(final=True)

    async def sync_weights(self, metrics: dict[str, float]) -> None:
        """Deploy the new version, retrying `sync_retries` times. A failed sync is not fatal: rollout keeps the
        older weights (the builder's staleness filter bounds the damage), the next step syncs again, and the
        weight exchange catches a lagging receiver up by itself."""
        if self.sender is None:
            return
        started = now()
        for attempt in range(self.config.sync_retries + 1):
            try:
                reply = await self.sender.sync(self.version, timeout=self.config.sync_timeout,
                                               transport=self.config.weight_transport)
                break
            except grpc.aio.AioRpcError as exc:  # a precondition (no receiver yet, receivers ahead) is not retried
                retry = attempt < self.config.sync_retries and exc.code() not in NO_RETRY
                (self.log.warning if retry else self.log.error)(
                    "weight_sync_failed", version=self.version, attempt=attempt + 1, code=str(exc.code()),
                    details=exc.details())
                if not retry:
                    self.sync_failures += 1
                    metrics["weight_sync_failures"] = float(self.sync_failures)
                    return
                await asyncio.sleep(min(2.0 ** attempt, 10.0))
        metrics["weight_sync_seconds"] = now() - started
        metrics["weight_sync_receivers"] = float(reply.num_receivers)

    async def checkpoint(self, path: str = "", *, final: bool = False, required: bool = True) -> pathlib.Path | None:
        """Write a checkpoint (resumable unless `final`) and announce it. Disk errors are retried; then a
        checkpoint that is not `required` is given up (None: the next one comes `checkpoint_every` steps later)."""
        target = pathlib.Path(path) if path else self.run_dir / ("final" if final else f"checkpoints/v{self.version}")
        async with self.lock:
            version = self.version
            for attempt in range(CHECKPOINT_ATTEMPTS):
                try:
                    out = await asyncio.to_thread(self._save, target, version, not final)
                    break
                except OSError as exc:
                    self.log.error("checkpoint_failed", path=str(target), version=version, attempt=attempt + 1,
                                   error=repr(exc))
                    if attempt + 1 == CHECKPOINT_ATTEMPTS:
                        if required or final:
                            raise
                        return None
                    await asyncio.sleep(2.0 ** attempt)
            if not path and not final:
                await asyncio.to_thread(prune_checkpoints, self.checkpoints, self.config.keep_checkpoints)
        event = data_pb2.VersionEvent(event_id=f"checkpoint-{version}-{target.name}", version=version,
                                      kind=data_pb2.VERSION_KIND_CHECKPOINT, at=now(), checkpoint_path=str(out))
        await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        self.log.info("checkpoint", path=str(out), version=version, final=final)
        return out

    def _save(self, target: pathlib.Path, version: int, resumable: bool) -> pathlib.Path:
        lineage = {key: list(value) for key, value in self.lineage.items()}
        state = None
        if resumable:
            counters = {key: getattr(self, key) for key in COUNTERS}
            state = {"engine": self.engine.state(), "trainer": {**counters, "version": version, "lineage": lineage}}
        return self.engine.save(target, version=version, state=state, lineage=lineage)

    def _append_metrics(self, metrics: dict[str, float]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "trainer_metrics.jsonl", "a") as f:
            f.write(json.dumps({"version": self.version, **metrics}) + "\n")


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    async def Status(self, request, context):
        t = self.t
        return trainer_pb2.TrainerStatus(
            policy_version=t.version, steps=t.version, paused=not t.running.is_set(), algorithm=t.config.algo,
            last_metrics=t.last_metrics, trajectories_trained=t.trajectories_trained,
            max_staleness_trained=t.max_staleness, dead_letters=t.dead_letters.counts)

    async def Checkpoint(self, request, context):
        out = await self.t.checkpoint(request.path)
        return trainer_pb2.CheckpointReply(path=str(out), version=self.t.version)

    async def Pause(self, request, context):
        self.t.running.clear()
        return common_pb2.Ack(ok=True, message="training paused after the current step")

    async def Resume(self, request, context):
        self.t.running.set()
        return common_pb2.Ack(ok=True, message="training resumed")


async def serve(config: TrainerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, name=config.rank_id, replicas=config.nats_replicas)
    trainer = Trainer(config, bus)
    trainer.resume()
    rpc = await start_server(config.grpc_address, [Servicer(
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(trainer),
        trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name)], auth_token=config.auth_token)
    tasks: list[asyncio.Task] = [asyncio.create_task(trainer.dead_letters.run(stop), name="dead-letter-counts")]
    supervise(tasks, stop)
    try:
        if config.wx_address:
            from services.weight_exchange.client import SenderAgent

            sender = SenderAgent(rank_id=config.rank_id, params=trainer.engine.weights(),
                                 wx_address=config.wx_address, token=config.auth_token,
                                 transports=(config.weight_transport,), host=config.weight_host)
            sender.end_update(trainer.version)  # the parameters hold the resumed version
            await sender.open()
            trainer.sender = sender
            # register, then heartbeat (re-registers after a weight_exchange restart)
            tasks.append(asyncio.create_task(sender.keep_registered(stop), name="wx_register"))
            supervise(tasks[-1:], stop)
            # a Sync before this process's registration landed would use a dead predecessor's endpoints
            await wait_either(sender.registered, stop)
        engine = trainer.engine
        get_logger().info("serving", grpc_port=rpc.port, algo=config.algo, lora=config.lora.enabled,
                          critic=engine.critic is not None, reference=engine.reference is not None,
                          trainable_parameters=engine.trainable_parameters(), version=trainer.version,
                          resumed_from=str(trainer.resumed_from or ""))
        await trainer.run(stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if trainer.sender is not None:
            await trainer.sender.close()
        await rpc.stop()
        await bus.close()

