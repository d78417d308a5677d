"""The rollout service's edges: pulls prompt work from JetStream, publishes trajectories, serves gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import time

import grpc
import prometheus_client

from services.common import trajectory_groups
from services.common.auth import client_security
from services.common.bus import (
    SUBJECT_PROMPTS,
    SUBJECT_TRAJ_RAW,
    SUBJECT_TRAJ_SCORED,
    SUBJECT_VERSIONS,
    Bus,
    InvalidMessage,
    consume,
    decoder,
    follow,
)
from services.common.contracts import common_pb2, data_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.deadletters import DeadLetterWatch
from services.common.errors import FieldError, field_error
from services.common.group_commit import GroupCommit
from services.common.hf_models import Pixels
from services.common.images import ImageStore
from services.common.logging import get_logger
from services.common.rpc import (
    DEFAULT_MAX_RECEIVE,
    LARGE_MAX_RECEIVE,
    Servicer,
    bound_address,
    invalid_argument,
)
from services.common.runtime import ServiceRuntime, cancel_and_wait, sleep_or_stop
from services.common.service import supervise
from services.rollout.config import RolloutConfig
from services.rollout.engines.base import (
    MAX_SAMPLES,
    Engine,
    EngineUnhealthy,
)
from services.rollout.engines.sequence import Images, Sampling
from services.rollout.workflows.single_turn import sampling_from_proto, to_trajectories, validate_work

TRAJECTORIES = prometheus_client.Counter("meshrl_rollout_trajectories_total", "Trajectories published")
TOKENS = prometheus_client.Gauge("meshrl_rollout_tokens_generated", "Tokens generated")
VERSION = prometheus_client.Gauge("meshrl_rollout_policy_version", "Policy version served")
PREFIX_LOOKUP = prometheus_client.Gauge("meshrl_rollout_prefix_cache_lookup_tokens",
                                        "Prompt tokens of the contexts prefilled (engines with a prefix cache)")
PREFIX_HIT = prometheus_client.Gauge("meshrl_rollout_prefix_cache_hit_tokens",
                                     "Prompt tokens whose KV came from the prefix cache")
PREFIX_BYTES = prometheus_client.Gauge("meshrl_rollout_prefix_cache_bytes", "Bytes of KV the prefix cache holds")


class Rollout:
    """State shared by the consumer loop and the gRPC handlers."""

    def __init__(self, config: RolloutConfig, engine: Engine, bus: Bus) -> None:
        self.config = config
        self.engine = engine
        self.bus = bus
        self.pull_gate = asyncio.Event()
        self.pull_gate.set()
        self.holds: set[str] = set()  # why the gate is closed: "rpc" (Pause), "weights" (stale after a restart)
        self.published = 0
        self.raw: GroupCommit[list[data_pb2.Trajectory]] = GroupCommit(
            lambda groups: trajectory_groups.publish_together(bus, SUBJECT_TRAJ_RAW, groups), most=64,
            name="traj-raw")
        self.dead_letters = DeadLetterWatch(bus)
        self.image_store = ImageStore(bus)  # a vision-language model's prompt images, by digest
        self._pixels: Pixels | None = None
        self.log = get_logger().bind(rank_id=config.rank_id)

    async def images_of(self, work: data_pb2.PromptWork, sampling) -> Images | None:
        """The work's images as the engine takes them (fetched by digest, through the model's image processor),
        checked against the prompt's placeholders; InvalidMessage naming the field when they can never run."""
        if not work.images:
            return None
        if getattr(self.engine, "image_slots", None) is None:
            raise InvalidMessage(f"images: the {self.engine.kind} engine here takes no images (a vision-language "
                                 "model on the embedded engine does)")
        if self._pixels is None:
            self._pixels = await asyncio.to_thread(Pixels, self.config.engine.model_path)
        blobs = await self.image_store.get_all(work.images)
        try:
            pixels = await asyncio.to_thread(self._pixels, blobs)
            images = Images(key=tuple(ref.sha256 for ref in work.images), pixel_values=pixels)
            self.engine.check(list(work.prompt_ids), sampling, work.group_size, images)
        except ValueError as exc:
            raise InvalidMessage(str(exc)) from exc
        return images

    def hold(self, reason: str) -> None:
        self.holds.add(reason)
        self.pull_gate.clear()

    def release(self, reason: str) -> None:
        self.holds.discard(reason)
        if not self.holds:
            self.pull_gate.set()

    async def handle_work(self, work: data_pb2.PromptWork) -> None:
        sampling = validate_work(work, self.engine)  # InvalidMessage (dead-lettered) before anything is admitted
        images = await self.images_of(work, sampling)
        seqs = await self.engine.generate(list(work.prompt_ids), sampling, n=work.group_size,
                                          **({"images": images} if images is not None else {}))
        if any(s.finish_reason == "error" for s in seqs):
            raise InvalidMessage(f"work {work.work_id}: the model failed on this prompt")
        if any(s.finish_reason == "abort" for s in seqs):
            raise RuntimeError(f"work {work.work_id} aborted by shutdown")
        trajectories = to_trajectories(work, seqs)
        # with the groups that finish while the previous publish is in flight, as one bundle; returns once it is
        # stored (the work is acked after). A redelivered work's group has the same members' ids: the reward
        # service publishes it scored under the same id again, which JetStream deduplicates on traj.scored, and
        # the builder keeps one trajectory per id, so a failure here loses and duplicates nothing
        await self.raw.add(trajectories)
        self.published += len(trajectories)
        TRAJECTORIES.inc(len(trajectories))
        TOKENS.set(self.engine.stats.tokens_generated)
        VERSION.set(self.engine.version)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, rollout: Rollout) -> None:
        self.r = rollout
        self._paused_by_rpc = False

    async def Generate(self, request, context):
        # everything is checked before anything is admitted: a bad request never reaches a shared model step
        if not request.prompt_ids:
            await invalid_argument(context, "prompt_ids", "empty")
        try:
            sampling = sampling_from_proto(request.sampling) if request.HasField("sampling") else Sampling()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not 0 <= request.n <= MAX_SAMPLES:
            await invalid_argument(context, "n", f"must be in [1, {MAX_SAMPLES}] (0: 1), got {request.n}")
        try:
            self.r.engine.check(list(request.prompt_ids), sampling, request.n or 1)
            seqs = await self.r.engine.generate(list(request.prompt_ids), sampling, n=request.n or 1)
        except ValueError as exc:
            await invalid_argument(context, field_error(exc) or FieldError("prompt_ids", str(exc)))
        except EngineUnhealthy as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is unhealthy: {exc}")
        return rollout_pb2.GenerateReply(completions=[
            rollout_pb2.Completion(token_ids=s.output_ids, logprobs=s.logprobs, versions=s.versions,
                                   finish_reason=s.finish_reason) for s in seqs])

    async def Pause(self, request, context):
        if not self._paused_by_rpc:
            self.r.hold("rpc")
            await self.r.engine.pause_async()
            self._paused_by_rpc = True
        return common_pb2.Ack(ok=True, message="paused")

    async def Resume(self, request, context):
        if self._paused_by_rpc:
            await self.r.engine.resume_async()
            self.r.release("rpc")
            self._paused_by_rpc = False
        return common_pb2.Ack(ok=True, message="resumed")

    async def Status(self, request, context):
        e = self.r.engine
        return rollout_pb2.RolloutStatus(
            policy_version=e.version, paused=self._paused_by_rpc or e.paused, running_sequences=e.num_running(),
            waiting_sequences=e.num_waiting(), trajectories_published=self.r.published,
            tokens_generated=e.stats.tokens_generated, weight_updates=e.stats.weight_updates,
            interrupted_sequences=e.stats.interrupted_sequences, engine=e.kind,
            dead_letters=self.r.dead_letters.counts, prefix_cache_lookup_tokens=e.stats.prefix_cache_lookup_tokens,
            prefix_cache_hit_tokens=e.stats.prefix_cache_hit_tokens)


async def serve(config: RolloutConfig, stop: asyncio.Event) -> None:
    engine = config.engine.build(run_dir=config.run_dir)
    PREFIX_LOOKUP.set_function(lambda: engine.stats.prefix_cache_lookup_tokens)  # read at each scrape
    PREFIX_HIT.set_function(lambda: engine.stats.prefix_cache_hit_tokens)
    PREFIX_BYTES.set_function(lambda: engine.stats.prefix_cache_bytes)
    await asyncio.to_thread(engine.start)  # a server engine takes minutes to start: the event loop stays free
    async with ServiceRuntime(config, stop) as runtime:
        runtime.when_drained(engine.stop)  # aborts what is left after the drain; those handlers nak their work
        bus = await runtime.connect_bus(config.rank_id)
        rollout = Rollout(config, engine, bus)

        def stopping() -> None:
            rollout.log.info("stopping", running=engine.num_running())
            rollout.pull_gate.set()

        runtime.when_stopping(stopping)
        servicers = [Servicer(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, RolloutServicer(rollout),
                              rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name)]
        receiver = _weight_receiver(config, engine)
        if receiver is not None:
            servicers.append(receiver.servicer())
            rollout.hold("weights")  # until the weights are known to be the trainer's, not stale ones (a restart)
        rpc = await runtime.serve_grpc(
            servicers, max_receive_bytes=LARGE_MAX_RECEIVE if receiver is not None else DEFAULT_MAX_RECEIVE)
        address = bound_address(config.grpc_address, rpc.port)
        rollout.log.info("serving", grpc=address, subject=SUBJECT_PROMPTS, version=engine.version)
        runtime.spawn(consume(bus, "rollout", decoder(data_pb2.PromptWork), rollout.handle_work, stop,
                              concurrency=config.concurrency, gate=rollout.pull_gate), "consume")
        runtime.spawn(rollout.dead_letters.run(stop), "dead-letter-counts")
        runtime.spawn(watch_health(rollout, rpc, stop), "engine-health")
        # a server engine's death takes the service down (the supervisor restarts both)
        runtime.spawn(engine.watch(stop), "engine-watch")
        if config.gateway_enabled:
            runtime.spawn(_serve_gateway(config, engine, bus, stop), "gateway")
        if receiver is not None:
            runtime.spawn(receiver.keep_registered(stop, agent_address=address), "wx-register")
            runtime.spawn(open_when_current(rollout, receiver, config.catch_up_timeout, stop), "wx-catch-up")
        await runtime.until_stopped()


async def watch_health(rollout: Rollout, rpc, stop: asyncio.Event, every: float = 1.0) -> None:
    """Once the engine turns unhealthy, the service says so: health NOT_SERVING (an orchestrator restarts it),
    no more prompt work pulled (other replicas take it), and one error line naming the cause."""
    while not stop.is_set() and rollout.engine.failure is None:
        await sleep_or_stop(stop, every)
    if rollout.engine.failure is not None:
        rollout.hold("engine")
        await rpc.set_serving(False)
        rollout.log.error("rollout_not_serving", reason=f"the engine is unhealthy: {rollout.engine.failure}")


class PauseClock:
    """Phase times of the engine per weight update, one JSON line each in run_dir/rollout_metrics.jsonl (the run
    report puts them into metrics.jsonl and phases.png): how long the engine took to stand still after the pause
    request (its step in flight), how long it stood paused while the weights moved, and, since the previous
    update, how long it worked (model steps) and the tokens it generated."""

    def __init__(self, engine: Engine, path: pathlib.Path) -> None:
        self.engine = engine
        self.path = path
        self.requested = self.paused = self.last = time.monotonic()
        self.busy, self.tokens, self.steps = 0.0, 0, 0

    async def pause(self) -> None:
        self.requested = time.monotonic()
        await self.engine.pause_async()
        self.paused = time.monotonic()

    async def resume(self, version: int) -> None:
        updated = version != self.engine.version
        await self.engine.resume_async(version)
        if updated:
            self.record(version)

    def record(self, version: int) -> None:
        at, stats = time.monotonic(), self.engine.stats
        line = {"version": version, "engine_pause_seconds": at - self.paused,
                "pause_drain_seconds": self.paused - self.requested, "interval_seconds": at - self.last,
                "engine_busy_seconds": stats.busy_seconds - self.busy, "tokens": stats.tokens_generated - self.tokens,
                "engine_steps": stats.steps - self.steps}
        self.last, self.busy, self.tokens, self.steps = at, stats.busy_seconds, stats.tokens_generated, stats.steps
        with contextlib.suppress(OSError):  # timing is a report, never a reason to fail an update
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")


def _weight_receiver(config: RolloutConfig, engine: Engine):
    if not config.wx_address:
        return None
    from services.weight_exchange.client import ReceiverAgent

    clock = PauseClock(engine, pathlib.Path(config.run_dir) / "rollout_metrics.jsonl")
    return ReceiverAgent(rank_id=config.rank_id, **engine.weight_receiver_args(), wx_address=config.wx_address,
                         **client_security(config), on_pause=clock.pause, on_resume=clock.resume,
                         version=engine.version)


async def open_when_current(rollout: Rollout, receiver, timeout: float, stop: asyncio.Event) -> None:
    """Release the "weights" hold once the engine has the trainer's weights: after the first registration, when
    the senders report a newer version than the engine's, wait until the service has caught this rank up.
    Each wait (registration, catch-up) opens the gate anyway, with a warning, after `timeout` seconds."""
    try:
        if not await _wait_until(receiver.registered.is_set, stop, timeout):
            if not stop.is_set():
                rollout.log.warning("weights_unknown", reason=f"not registered with weight_exchange in {timeout}s")
            return
        target = receiver.last_reply.sender_version
        if target <= rollout.engine.version:
            return
        rollout.log.info("catching_up", version=rollout.engine.version, sender_version=target)
        if await _wait_until(lambda: rollout.engine.version >= target, stop, timeout):
            rollout.log.info("caught_up", version=rollout.engine.version)
        elif not stop.is_set():
            rollout.log.warning("catch_up_timeout", version=rollout.engine.version, sender_version=target,
                                reason=f"generating with version {rollout.engine.version} after {timeout}s")
    finally:
        rollout.release("weights")


async def _wait_until(condition, stop: asyncio.Event, timeout: float) -> bool:
    """True once `condition()` holds; False when `stop` is set or `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if stop.is_set() or time.monotonic() >= deadline:
            return False
        await sleep_or_stop(stop, min(0.1, max(0.0, deadline - time.monotonic())))
    return True


async def _serve_gateway(config: RolloutConfig, engine: Engine, bus: Bus, stop: asyncio.Event) -> None:
    """Agents' trajectories carry the reward they reported: they go straight to traj.scored (a session graded by a
    verifier's, to traj.raw; the reward service also runs agents' code, /rl/run_code). New agent groups
    are admitted under the staleness budget the builder announces on events.version."""
    from transformers import AutoTokenizer

    from services.rollout.gateway import GroupBudget, create_app, serve_gateway

    tokenizer = AutoTokenizer.from_pretrained(config.engine.model_path)

    async def publish(members: list[data_pb2.Trajectory]) -> None:  # a graded session's go through the reward service
        await trajectory_groups.publish(bus, SUBJECT_TRAJ_SCORED if members[0].scored else SUBJECT_TRAJ_RAW, members)

    budget = GroupBudget()
    reward = None
    if config.reward_address:
        from services.reward.client import RewardClient
        reward = RewardClient(config.reward_address, **client_security(config))
    feed = asyncio.create_task(follow_budget(bus, budget, stop), name="gateway-budget")
    supervise([feed], stop)
    try:
        await serve_gateway(create_app(config.gateway, engine, tokenizer, publish, budget, run_dir=config.run_dir,
                                       reward=reward, vision=_vision(config, engine, tokenizer, bus)),
                            config.gateway, stop)
    finally:
        await cancel_and_wait([feed])
        if reward is not None:
            await reward.close()


def _vision(config: RolloutConfig, engine: Engine, tokenizer, bus: Bus):
    """The gateway's image handling for a vision-language policy on the embedded engine; None otherwise."""
    slots = getattr(engine, "image_slots", None)
    if slots is None:
        return None
    from services.rollout.gateway.images import Vision

    token_id, per_image = slots
    return Vision(token_text=tokenizer.convert_ids_to_tokens(token_id), token_id=token_id, per_image=per_image,
                  pixels=Pixels(config.engine.model_path), store=ImageStore(bus))


async def follow_budget(bus: Bus, budget, stop: asyncio.Event) -> None:
    """Feed the builder's budget events (source: online) to the gateway, from the stream's start, per replica."""
    def on_event(event: data_pb2.VersionEvent) -> None:
        if event.kind != data_pb2.VERSION_KIND_BUDGET:
            return
        if not event.HasField("budget"):
            raise FieldError("budget", f"missing in budget event {event.event_id!r}")
        b = event.budget
        budget.update(limit=b.limit_groups, released=b.released_groups, arrived=b.arrived_groups)

    await follow(bus, SUBJECT_VERSIONS, decoder(data_pb2.VersionEvent), on_event, stop)
