"""The trainer service's edges: reads training batches by index, publishes version events, syncs weights,
writes checkpoints, serves gRPC.

Batch i is trained at policy version i, read from the BATCHES stream by index (the stream keeps batches),
so a trainer restarted from its newest complete checkpoint (version v) reads batch v next and its
lineage applies every batch index exactly once.
"""

from __future__ import annotations

import asyncio
import json
import pathlib

import grpc
import prometheus_client
import torch

from services.common.auth import client_security
from services.common.batches import batch_subject, wait_batch
from services.common.bus import SUBJECT_VERSIONS, TRANSIENT, Bus, InvalidMessage, wait_either
from services.common.contracts import common_pb2, data_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.deadletters import DeadLetterWatch
from services.common.hf_models import Pixels
from services.common.ids import now
from services.common.images import ImageStore
from services.common.logging import get_logger
from services.common.rpc import Servicer, invalid_argument
from services.common.runtime import Backoff, ServiceRuntime, cancel_and_wait, sleep_or_stop
from services.common.service import supervise
from services.trainer.batching import distinct_versions, pack, trajectory_staleness
from services.trainer.checkpoint import MANIFEST, latest_checkpoint, prune_checkpoints, read_lineage, remove_leftovers
from services.trainer.compute_thread import ComputeThread
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainerBackend, build_engine

VERSION = prometheus_client.Gauge("meshrl_trainer_policy_version", "Trainer policy version")
STEP_METRICS = prometheus_client.Gauge("meshrl_trainer_step_metric", "Last step metrics", ["name"])
STALENESS = prometheus_client.Histogram("meshrl_trainer_staleness", "Trajectory staleness when trained",
                                        buckets=(0, 1, 2, 3, 4, 6, 8, 16))
BATCH_STALENESS = prometheus_client.Gauge("meshrl_trainer_batch_staleness_trajectories",
                                          "Trajectories of the last batch by staleness (versions)", ["staleness"])
SKIPPED = prometheus_client.Counter("meshrl_trainer_batches_skipped", "Batches dead-lettered and skipped")
CHECKPOINT_ATTEMPTS = 3
# The first registration with the weight exchange, which may start after the trainer: as long as the bus's connect
# deadline. Past it the trainer exits naming the address (its supervisor restarts it) instead of idling unseen.
REGISTER_TIMEOUT_S = 600.0
COUNTERS = ("version", "trajectories_trained", "max_staleness", "max_versions", "sync_failures")  # resumed
NO_RETRY = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def setup_torch(config: TrainerConfig) -> ComputeThread:
    """Seed torch; the thread for the model's work, with `torch_threads` (the main thread is left at one)."""
    torch.manual_seed(config.seed)
    return ComputeThread(config.torch_threads)


class Trainer:
    def __init__(self, config: TrainerConfig, bus: Bus, engine: TrainerBackend | None = None,
                 compute: ComputeThread | None = None) -> None:
        """``engine``: rank 0 of a rank group (``backends.leader.Leader``), with the ``compute`` thread that built it;
        else both are made here from ``config``. Every model operation runs on ``compute``."""
        self.config = config
        self.bus = bus
        self.image_store = ImageStore(bus)    # a vision-language batch's images, by digest
        self._pixels: Pixels | None = None
        if engine is None:
            compute = setup_torch(config)
            engine = compute.call(build_engine, config)
        assert compute is not None, "a given engine comes with the thread that built it"
        self.compute = compute
        self.engine = engine
        self.version = 0
        self.trajectories_trained = 0
        self.max_staleness = 0
        self.max_versions = 0
        self.last_metrics: dict[str, float] = {}
        self.lineage: dict[str, list] = {"batch_indices": [], "batch_ids": [], "skipped": []}
        self.resumed_from: pathlib.Path | None = None
        self.checkpointed = -1  # the version of the newest resumable checkpoint written or resumed from
        self.sender = None
        self.dead_letters = DeadLetterWatch(bus)
        self.sync_failures = 0
        self.running = asyncio.Event()
        self.running.set()
        self.lock = asyncio.Lock()  # a step and a checkpoint never overlap
        self.run_dir = pathlib.Path(config.run_dir)
        self.checkpoints = self.run_dir / "checkpoints"
        self.log = get_logger().bind(rank_id=config.rank_id)
        self.batch_wait = 0.0  # seconds the last batch was waited for (idle trainer)
        self.last_sync = 0.0  # seconds the last weight sync took (it follows its TRAINED event: reported in the next)

    def resume(self) -> pathlib.Path | None:
        """Load the newest complete checkpoint in run_dir/checkpoints (incomplete ones are removed)."""
        prune_checkpoints(self.checkpoints, self.config.keep_checkpoints)
        remove_leftovers(self.run_dir, "final")
        path = latest_checkpoint(self.checkpoints)
        if path is None:
            self.log.info("fresh_start", version=self.version)
            return None
        t = self.compute.call(self.engine.restore, path)["trainer"]
        for key in COUNTERS:
            setattr(self, key, t[key])
        self.lineage = {key: list(value) for key, value in t["lineage"].items()}
        self.resumed_from = path
        self.checkpointed = self.version
        VERSION.set(self.version)
        self.log.info("resumed", resumed_from=str(path), version=self.version)
        return path

    async def run(self, stop: asyncio.Event) -> None:
        """Train batch `version`, then the next, until `stop`; waits while paused."""
        await self.finish_if_done()
        backoff = Backoff(initial=0.5, cap=10.0)
        while not stop.is_set():
            if not self.running.is_set():
                await wait_either(self.running, stop)
                continue
            index = self.version
            waiting = now()
            try:
                batch = await wait_batch(self.bus, index, stop)
            except InvalidMessage as exc:
                await self.skip(index, str(exc))
                continue
            except TRANSIENT as exc:  # NATS away longer than the bus's retries: keep waiting for it
                delay = backoff.next()
                self.log.warning("batch_read_failed", index=index, retry_in=delay, error=repr(exc))
                await sleep_or_stop(stop, delay)
                continue
            backoff.reset()
            if batch is None:
                break
            if self.running.is_set():  # paused while waiting: read it again on resume
                self.batch_wait = now() - waiting
                await self.handle_batch(batch)

    async def handle_batch(self, batch: data_pb2.TrainingBatch) -> None:
        if batch.index != self.version:
            self.log.warning("batch_out_of_turn", index=batch.index, version=self.version)
            return
        started = now()
        try:
            pixels = await self.pixels_of(batch.trajectories)
            packed = pack(list(batch.trajectories), self.engine.pad_token_id, temperature=self.config.temperature,
                          pixels=pixels)
            self.engine.check_token_ids(packed)
        except ValueError as exc:
            await self.skip(batch.index, str(exc))
            return
        staleness = [trajectory_staleness(t, self.version) for t in batch.trajectories]
        phases = {"phase_batch_wait_seconds": self.batch_wait, "phase_pack_seconds": now() - started,
                  "phase_previous_weight_sync_seconds": self.last_sync, **pipeline_phases(batch)}
        started = now()
        async with self.lock:
            metrics = await self.compute.run(self._step, packed, self.version)
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
                       batch_index=float(batch.index), **phases)
        await self.after_step(metrics)
        self.log.info("step", version=self.version, reward=round(metrics["reward_mean"], 3),
                      loss=round(metrics.get("loss", 0.0), 4), staleness=int(max(staleness)))

    async def pixels_of(self, trajectories) -> dict[str, torch.Tensor]:
        """Each image the batch names, by digest, as the policy's vision tower takes it (float[C, H, W]); a batch
        naming an image that is gone or unreadable raises InvalidMessage / ValueError and is skipped."""
        refs = {ref.sha256: ref for t in trajectories for ref in t.images}
        if not refs:
            return {}
        if self._pixels is None:
            self._pixels = await asyncio.to_thread(Pixels, self.config.model_path)
        blobs = await self.image_store.get_all(list(refs.values()))
        pixels = await asyncio.to_thread(self._pixels, blobs)
        return dict(zip(refs, pixels, strict=True))

    def _step(self, packed, version: int) -> dict[str, float]:
        """On the compute thread: the step, bracketed for the weight-sync sender (no torn reads)."""
        if self.sender is not None:
            self.sender.begin_update()
        metrics = {**self.engine.step(packed, version), **self.engine.last_phases}
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

    async def checkpoint_at_stop(self) -> None:
        """Stopped (SIGTERM, SIGINT) with steps since the newest resumable checkpoint: keep them, so a restart
        resumes from here instead of training those batches again. Not for a rank group: its other ranks stop on
        the same signal and cannot take part in gathering the weights any more."""
        if not self.config.checkpoint_on_stop or self.config.ranks > 1 or self.version <= max(self.checkpointed, 0):
            return
        try:
            await self.checkpoint(required=False)
        except Exception as exc:  # noqa: BLE001 - e.g. NATS already gone for the announcement: the files are written
            self.log.warning("stop_checkpoint_unannounced", version=self.version, error=repr(exc))

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
        metrics["weight_sync_seconds"] = self.last_sync = now() - started
        metrics["weight_sync_receivers"] = float(reply.num_receivers)

    async def checkpoint(self, path: str = "", *, final: bool = False, required: bool = True) -> pathlib.Path | None:
        """Write a checkpoint (resumable unless `final`) and announce it. Disk errors are retried; then a
        checkpoint that is not `required` is given up (None: the next one comes `checkpoint_every` steps later)."""
        target = pathlib.Path(path) if path else self.run_dir / ("final" if final else f"checkpoints/v{self.version}")
        async with self.lock:
            version = self.version
            for attempt in range(CHECKPOINT_ATTEMPTS):
                try:
                    out = await self.compute.run(self._save, target, version, not final)
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
                self.checkpointed = version
                await asyncio.to_thread(prune_checkpoints, self.checkpoints, self.config.keep_checkpoints)
        event = data_pb2.VersionEvent(event_id=f"checkpoint-{version}-{target.name}", version=version,
                                      kind=data_pb2.VERSION_KIND_CHECKPOINT, at=now(), checkpoint_path=str(out))
        await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        self.log.info("checkpoint", path=str(out), version=version, final=final)
        return out

    def _save(self, target: pathlib.Path, version: int, resumable: bool) -> pathlib.Path:
        self.engine.gather_weights()
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


def pipeline_phases(batch: data_pb2.TrainingBatch) -> dict[str, float]:
    """Mean seconds the batch's trajectories spent in each service before the trainer, from their timestamps:
    issued -> generated (queue + generation), generated -> scored (reward), scored -> batched (grouping)."""
    trajs = [t for t in batch.trajectories if t.created_at and t.generated_at and t.scored_at]
    if not trajs:
        return {}
    n = len(trajs)
    out = {"phase_generation_latency_seconds": sum(t.generated_at - t.created_at for t in trajs) / n,
           "phase_reward_latency_seconds": sum(t.scored_at - t.generated_at for t in trajs) / n}
    if batch.created_at:
        out["phase_batching_latency_seconds"] = sum(batch.created_at - t.scored_at for t in trajs) / n
    return out


RESERVED = ("secrets", "nats", "config", "logs")  # parts of the run directory no checkpoint may land in


def confined_checkpoint_path(run_dir: str | pathlib.Path, requested: str) -> pathlib.Path:
    """Where a Checkpoint RPC may write `requested` (relative to the run directory, or absolute inside it); a
    checkpoint replaces what is at its path, so ValueError for anything outside the run directory, the run
    directory itself, its secrets/nats/config/logs, a symlink, or an existing path that is not a checkpoint."""
    root = pathlib.Path(run_dir).resolve()
    asked = pathlib.Path(requested)
    target = asked if asked.is_absolute() else root / asked
    if target.name in ("", ".", ".."):
        raise ValueError(f"{requested!r} does not name a directory inside the run directory")
    full = target.parent.resolve() / target.name
    if full == root or not full.is_relative_to(root):
        raise ValueError(f"{requested!r} is outside the run directory {root}")
    if full.relative_to(root).parts[0] in RESERVED:
        raise ValueError(f"{requested!r} is in the run directory's {full.relative_to(root).parts[0]}/ (reserved)")
    if full.is_symlink():
        raise ValueError(f"{requested!r} is a symlink")
    if full.exists() and not (full.is_dir() and (full / MANIFEST).is_file()):
        raise ValueError(f"{requested!r} exists and is not a checkpoint; refusing to replace it")
    return full


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
        path = ""
        if request.path:
            try:
                path = str(confined_checkpoint_path(self.t.run_dir, request.path))
            except ValueError as exc:
                await invalid_argument(context, "path", str(exc))
        out = await self.t.checkpoint(path)
        return trainer_pb2.CheckpointReply(path=str(out), version=self.t.version)

    async def Pause(self, request, context):
        self.t.running.clear()
        return common_pb2.Ack(ok=True, message="training paused after the current step")

    async def Resume(self, request, context):
        self.t.running.set()
        return common_pb2.Ack(ok=True, message="training resumed")


async def serve(config: TrainerConfig, stop: asyncio.Event) -> None:
    """One trainer rank: rank 0 is the service; the other ranks of a group follow its commands."""
    leader, compute = None, None
    if config.ranks > 1:
        from services.trainer.backends.leader import Leader, follow

        compute = setup_torch(config)
        engine = await compute.run(build_engine, config)  # joins the group: every rank must arrive
        if engine.rank != 0:
            await follow_rank0(config, engine, compute, stop, follow)
            return
        leader = Leader(engine, config.rank_timeout)
        beat = asyncio.create_task(heartbeat(leader, stop), name="trainer-ranks-heartbeat")
        supervise([beat], stop)  # from here on: bus connection and resume may take a while
    try:
        await serve_rank0(config, stop, leader, compute)
    finally:
        if leader is not None:
            await cancel_and_wait([beat])
            await asyncio.to_thread(leader.stop)


def weight_sender(config: TrainerConfig, engine):
    """``shard_sync``: this rank's sender of its own live shards (rank 0 under ``rank_id``, rank r under
    ``rank_id``-dp``r`` for fsdp2, ``rank_id``-r``r`` for megatron), registered with their layout."""
    from services.weight_exchange.client import SenderAgent

    params, shards = engine.local_shards()
    framework, parallel = engine.sender_layout()
    suffix = "dp" if framework == "fsdp2" else "r"
    rank_id = config.rank_id if engine.rank == 0 else f"{config.rank_id}-{suffix}{engine.rank}"
    return SenderAgent(rank_id=rank_id, params=params, shards=shards, framework=framework,
                       parallel=parallel, wx_address=config.wx_address, **client_security(config),
                       transports=(config.weight_transport,), host=config.weight_host)


async def follow_rank0(config: TrainerConfig, engine, compute: ComputeThread, stop: asyncio.Event, follow) -> None:
    """A rank > 0: rank 0's commands; with ``shard_sync``, also serving this rank's shards to the weight sync."""
    sender, tasks = None, []
    if config.wx_address and config.shard_sync:
        sender = weight_sender(config, engine)
        await sender.open()
        tasks.append(asyncio.create_task(sender.keep_registered(stop), name="wx_register"))
        supervise(tasks, stop)
    try:
        await compute.run(follow, engine, config.rank_timeout, stop, sender)
    finally:
        await cancel_and_wait(tasks)
        if sender is not None:
            await sender.close()


async def wait_registered(sender, stop: asyncio.Event, address: str, timeout: float = REGISTER_TIMEOUT_S) -> None:
    """Until `sender` registered (or `stop`); RuntimeError naming the weight exchange past `timeout` seconds."""
    waiters = [asyncio.ensure_future(sender.registered.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if not (sender.registered.is_set() or stop.is_set()):
        raise RuntimeError(f"trainer: not registered with the weight exchange at {address} within {timeout:g}s "
                           "(see the register_failed warnings)")


async def heartbeat(leader, stop: asyncio.Event) -> None:
    """Rank 0 of a group while idle: a dead rank fails this task, which takes the service down."""
    while not stop.is_set():
        if not await sleep_or_stop(stop, leader.interval / 2):
            await asyncio.to_thread(leader.heartbeat)


async def serve_rank0(config: TrainerConfig, stop: asyncio.Event, leader=None,
                      compute: ComputeThread | None = None) -> None:
    async with ServiceRuntime(config, stop) as runtime:
        bus = await runtime.connect_bus(config.rank_id)
        trainer = Trainer(config, bus, engine=leader, compute=compute)
        runtime.on_close(trainer.compute.close)   # after the gRPC server and the sender, before the bus
        trainer.resume()
        rpc = await runtime.serve_grpc([Servicer(
            trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(trainer),
            trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name)])
        runtime.spawn(trainer.dead_letters.run(stop), "dead-letter-counts")
        if config.wx_address:
            from services.weight_exchange.client import SenderAgent

            sender = weight_sender(config, trainer.engine) if config.shard_sync else SenderAgent(
                rank_id=config.rank_id, params=trainer.engine.weights(), wx_address=config.wx_address,
                **client_security(config), transports=(config.weight_transport,), host=config.weight_host)
            sender.end_update(trainer.version)  # the parameters hold the resumed version
            await sender.open()
            trainer.sender = sender
            runtime.on_close(sender.close)
            # register, then heartbeat (re-registers after a weight_exchange restart)
            runtime.spawn(sender.keep_registered(stop), "wx_register")
            # a Sync before this process's registration landed would use a dead predecessor's endpoints
            await wait_registered(sender, stop, config.wx_address)
        engine = trainer.engine
        get_logger().info("serving", grpc_port=rpc.port, algo=config.algo, lora=config.lora.enabled,
                          backend=config.backend, ranks=config.ranks,
                          critic=engine.critic is not None, reference=engine.reference is not None,
                          trainable_parameters=engine.trainable_parameters(), version=trainer.version,
                          resumed_from=str(trainer.resumed_from or ""))
        await trainer.run(stop)
        await trainer.checkpoint_at_stop()

