"""The trainer service's edges: consumes training batches, publishes version events, syncs weights,
writes checkpoints, serves gRPC."""

from __future__ import annotations

import asyncio
import json
import pathlib

import grpc
import prometheus_client
import torch

from services.common.bus import SUBJECT_VERSIONS, Bus, InvalidMessage, consume, decoder
from services.common.contracts import common_pb2, data_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.ids import now
from services.common.logging import get_logger
from services.common.rpc import Servicer, call_until_ok, start_server
from services.trainer.batching import distinct_versions, pack, trajectory_staleness
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainerEngine

VERSION = prometheus_client.Gauge("meshrl_trainer_policy_version", "Trainer policy version")
STEP_METRICS = prometheus_client.Gauge("meshrl_trainer_step_metric", "Last step metrics", ["name"])
STALENESS = prometheus_client.Histogram("meshrl_trainer_staleness", "Trajectory staleness when trained",
                                        buckets=(0, 1, 2, 3, 4, 6, 8, 16))
BATCH_STALENESS = prometheus_client.Gauge("meshrl_trainer_batch_staleness_trajectories",
                                          "Trajectories of the last batch by staleness (versions)", ["staleness"])


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
        self.sender = None
        self.sync_failures = 0
        self.running = asyncio.Event()
        self.running.set()
        self.run_dir = pathlib.Path(config.run_dir)
        self.log = get_logger().bind(rank_id=config.rank_id)

    async def handle_batch(self, batch: data_pb2.TrainingBatch) -> None:
        if batch.index < self.version:
            self.log.warning("batch_already_trained", index=batch.index, version=self.version)
            return
        if batch.index > self.version:
            raise RuntimeError(f"batch {batch.index} arrived at version {self.version}; waiting for the earlier one")
        try:
            packed = pack(list(batch.trajectories), self.engine.pad_token_id)
        except ValueError as exc:
            raise InvalidMessage(str(exc)) from exc
        staleness = [trajectory_staleness(t, self.version) for t in batch.trajectories]
        started = now()
        metrics = await asyncio.to_thread(self.engine.step, packed, self.version)
        self.version += 1
        self.trajectories_trained += len(batch.trajectories)
        self.max_staleness = max(self.max_staleness, *staleness)
        self.max_versions = max(self.max_versions, *(distinct_versions(t) for t in batch.trajectories))
        for s in staleness:
            STALENESS.observe(s)
        metrics.update(step_seconds=now() - started, staleness_max_batch=float(max(staleness)),
                       max_staleness_trained=float(self.max_staleness), trajectories_trained=self.trajectories_trained,
                       max_versions_in_one_trajectory=float(self.max_versions), dropped_stale=float(batch.dropped_stale))
        self.last_metrics = metrics
        VERSION.set(self.version)
        BATCH_STALENESS.clear()  # the histogram's keys change from batch to batch
        for key, value in metrics.items():
            if key.startswith("staleness_hist_"):
                BATCH_STALENESS.labels(key.removeprefix("staleness_hist_")).set(value)
            else:
                STEP_METRICS.labels(key).set(value)
        # announce first: the builder admits the next work while the weights move, so generation
        # in flight is what the update interrupts
        event = data_pb2.VersionEvent(event_id=f"trained-{self.version}", version=self.version,
                                      kind=data_pb2.VERSION_KIND_TRAINED, at=now(), metrics=metrics)
        await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        await self.sync_weights(metrics)
        self._append_metrics(metrics)
        self.log.info("step", version=self.version, reward=round(metrics["reward_mean"], 3),
                      loss=round(metrics.get("loss", 0.0), 4), staleness=int(max(staleness)))
        total, every = self.config.total_steps, self.config.checkpoint_every
        if (total and self.version == total) or (every and self.version % every == 0):
            await self.checkpoint(final=bool(total) and self.version == total)

    async def sync_weights(self, metrics: dict[str, float]) -> None:
        """Deploy the new version. A failed sync is not fatal: rollout keeps the older weights (the
        builder's staleness filter bounds the damage) and the next step syncs again."""
        if self.sender is None:
            return
        started = now()
        try:
            reply = await self.sender.sync(self.version, timeout=self.config.sync_timeout,
                                           transport=self.config.weight_transport)
        except grpc.aio.AioRpcError as exc:
            self.sync_failures += 1
            metrics["weight_sync_failures"] = float(self.sync_failures)
            self.log.error("weight_sync_failed", version=self.version, code=str(exc.code()), details=exc.details())
            return
        metrics["weight_sync_seconds"] = now() - started
        metrics["weight_sync_receivers"] = float(reply.num_receivers)

    async def checkpoint(self, path: str = "", *, final: bool = False) -> pathlib.Path:
        target = pathlib.Path(path) if path else self.run_dir / ("final" if final else f"checkpoints/v{self.version}")
        out = await asyncio.to_thread(self.engine.save, target, version=self.version)
        event = data_pb2.VersionEvent(event_id=f"checkpoint-{self.version}-{target.name}", version=self.version,
                                      kind=data_pb2.VERSION_KIND_CHECKPOINT, at=now(), checkpoint_path=str(out))
        await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        self.log.info("checkpoint", path=str(out), version=self.version)
        return out

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
            max_staleness_trained=t.max_staleness)

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
    bus = await Bus.connect(config.nats_url, name=config.rank_id)
    trainer = Trainer(config, bus)
    rpc = await start_server(config.grpc_address, [Servicer(
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(trainer),
        trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name)], auth_token=config.auth_token)
    if config.wx_address:
        from services.weight_exchange.client import SenderAgent

        trainer.sender = SenderAgent(rank_id=config.rank_id, params=trainer.engine.weights(),
                                     wx_address=config.wx_address, token=config.auth_token,
                                     transports=(config.weight_transport,), host="127.0.0.1")
        await trainer.sender.open()
        await call_until_ok(trainer.sender.register, stop, what="weight_exchange")
    engine = trainer.engine
    get_logger().info("serving", grpc_port=rpc.port, algo=config.algo, lora=config.lora.enabled,
                      critic=engine.critic is not None, reference=engine.reference is not None,
                      trainable_parameters=engine.trainable_parameters())
    await consume(bus, "trainer", decoder(data_pb2.TrainingBatch), trainer.handle_batch, stop, gate=trainer.running)
    if trainer.sender is not None:
        await trainer.sender.close()
    await rpc.stop()
    await bus.close()
