"""The builder service's edges: issues prompt work under the staleness budget, groups scored
trajectories into training batches, runs held-out evals, serves gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pathlib
import time
from collections.abc import Callable

import prometheus_client
from transformers import AutoTokenizer

from services.builder.accounting import RunEnd, recount
from services.builder.acks import SharedAck
from services.builder.admission import OnlineBudget, StalenessBudget
from services.builder.capacity import TRAJ_SPEC, check_traj_capacity, longest_prompt_tokens
from services.builder.config import BuilderConfig
from services.builder.datasets import shuffled_epochs
from services.builder.evaluation import EvalRound, EvalTracker
from services.builder.grouping import (
    Group,
    GroupAssembler,
    assemble_batch,
    check_group_size,
    check_rewards,
    reward_varies,
)
from services.builder.ledger import NO_VARIANCE, Batched, Dropped, IssuedEval, Ledger, merge_batches
from services.builder.tasks import make_pair, make_work
from services.common import grading, trajectory_groups
from services.common.batches import BatchConflict, prune_blobs, publish_batch, published_batches
from services.common.bus import (
    CONSUMERS,
    SUBJECT_PROMPTS,
    SUBJECT_TRAJ_SCORED,
    SUBJECT_VERSIONS,
    TRANSIENT,
    Bus,
    InvalidMessage,
    consume,
    decoder,
    follow,
    wait_either,
)
from services.common.contracts import builder_pb2, builder_pb2_grpc, common_pb2, data_pb2
from services.common.deadletters import DeadLetterWatch
from services.common.errors import FieldError
from services.common.hf_models import is_vision_language
from services.common.ids import now
from services.common.images import ImageStore, ref_of
from services.common.logging import get_logger
from services.common.rpc import Servicer
from services.common.runtime import ServiceRuntime, sleep_or_stop
from services.common.sampling import temperature_mismatch
from services.common.service import supervise
from services.common.steps import check_step_rewards

# the trainer keeps its 2 newest checkpoints (trainer.keep_checkpoints) and resumes from the newest complete one:
# batches under the older one's version are never read again, and their blobs go (keeping more checkpoints than
# this and losing the two newest would find those batches' blobs gone: the trainer skips them, dead-lettered)
CHECKPOINTS_KEPT = 2
ISSUE_CHUNK = 64   # train groups counted in one ledger write and published together, at most
ISSUED = prometheus_client.Counter("meshrl_builder_groups_issued_total", "Prompt groups issued")
BATCHES = prometheus_client.Counter("meshrl_builder_batches_total", "Training batches published")
DROPPED = prometheus_client.Counter("meshrl_builder_dropped_stale_total", "Trajectories dropped as stale")
TRAJ_DISCARDED = prometheus_client.Gauge("meshrl_builder_traj_discarded",
                                         "TRAJ messages discarded over its byte cap above the builder's ack floor")
CAPACITY = prometheus_client.Gauge("meshrl_builder_capacity", "Groups that may still be admitted")
GROUPS_FILTERED = prometheus_client.Counter("meshrl_builder_groups_filtered_total",
                                            "Groups without reward variance dropped by dynamic sampling")
EXTRA_PROMPTS = prometheus_client.Counter("meshrl_builder_extra_prompts_total",
                                          "Prompt groups issued in the place of filtered ones")
PROMPTS_FILTERED = prometheus_client.Gauge("meshrl_builder_prompts_filtered",
                                          "Dataset rows dropped for prompts over dataset.max_prompt_tokens", ["split"])
GATEWAY_LIMIT = prometheus_client.Gauge("meshrl_builder_online_limit_groups",
                                        "Online groups the gateway may admit in all (limit + released)")


class Builder:
    def __init__(self, config: BuilderConfig, bus: Bus, encode, stop_token_ids: list[int],
                 encode_reply: Callable[[str], list[int]] | None = None) -> None:
        """``encode``: a task's prompt token ids (``config.dataset.encoder(tokenizer)``); ``encode_reply``: a
        reply's text as token ids (preference datasets: the tokenizer's, no special tokens added)."""
        self.config = config
        self.bus = bus
        self.encode = encode
        self.encode_reply = encode_reply
        self.log = get_logger()
        self.train_sampling = config.sampling.to_proto(stop_token_ids)
        self.eval_sampling = data_pb2.SamplingParams(temperature=0.0, top_p=1.0,
                                                     max_new_tokens=config.eval_max_new_tokens,
                                                     stop_token_ids=stop_token_ids)
        self.budget = StalenessBudget(config.batch_size, config.max_staleness)
        # source: online: the gateway admits agent groups against this (announced on events.version)
        self.online = OnlineBudget(config.batch_size, config.max_staleness) if config.source == "online" else None
        self.assembler = GroupAssembler()
        self.evals = EvalTracker(config.eval_every)
        data = config.dataset.build(seed=config.seed, train_size=config.train_size, eval_size=config.eval_size)
        data = data.filtered(lambda task: len(encode(task)), config.dataset.max_prompt_tokens)
        self.prompts_filtered = data.dropped
        for split, n in data.dropped.items():
            PROMPTS_FILTERED.labels(split=split).set(n)
        self.log.info("dataset_loaded", source=config.dataset.kind, train=len(data.train), eval=len(data.eval),
                      filtered_train=data.dropped["train"], filtered_eval=data.dropped["eval"])
        self.eval_tasks = data.eval
        # a vision-language dataset's images by digest: put in the IMAGES object store as work names them
        self.images = ImageStore(bus)
        self.image_blobs = {ref_of(b).sha256: b for t in (*data.train, *data.eval) for b in t.images}
        self.traj_in_flight_bytes = self.check_capacity(data)
        self.train = shuffled_epochs(data.train, config.seed)
        self.ledger = Ledger(bus)
        self.dead_letters = DeadLetterWatch(bus)
        self.groups_dropped = 0
        self.consumed_groups: set[str] = set()
        self.dropping: set[str] = set()  # dead-lettered groups whose drop is being recorded
        # the budget event last counted per group ("complete", "filtered"): a handler that failed after counting
        # (a NATS node lost mid-write) sees its group again on redelivery and must not count it twice
        self.counted: dict[str, str] = {}
        self.eval_acks: dict[int, list] = {}   # eval results held (unacked) until their round's event is out
        self.flush_lock = asyncio.Lock()        # one batch index is built at a time
        self.live = asyncio.Event()             # set once the state is recovered and the events replayed
        self.changed = asyncio.Event()
        self.admitting = asyncio.Event()
        self.admitting.set()
        self.deployed_version = 0
        self.batches_published = 0
        self.issued = 0
        # counted as issued, its publish not confirmed: prompt work, or a preference row's scored pair
        self.unpublished: list[data_pb2.PromptWork | list[data_pb2.Trajectory]] = []  # counted, not yet published
        self.received = 0
        self.dropped_stale = 0
        self.reward_sum = 0.0
        self.run_end = RunEnd(config.final_checkpoint_timeout_s)
        self.finished = asyncio.Event()
        self.traj_discarded = 0
        self.eval_since: dict[int, float] = {}  # eval round -> when it was issued (or recovered), monotonic
        self.in_flight_since: dict[str, float] = {}  # issued train group -> when (monotonic), until consumed
        self.checkpoints: list[int] = []  # versions of the newest CHECKPOINTS_KEPT checkpoint events
        self.blobs_pruned_below = 0
        self.failed = asyncio.Event()     # set with `failure`: a handler found an error that stops the service
        self.failure: BaseException | None = None

    def check_capacity(self, data) -> int:
        """The bytes of trajectories this run keeps in flight; FieldError (nats_max_bytes) when they do not fit
        TRAJ's byte cap with room to spare (over it TRAJ deletes unacked trajectories: finding F4)."""
        config = self.config
        traj_cap = self.bus.stream_max_bytes(TRAJ_SPEC) if self.bus is not None else -1  # None: pure tests
        tokens = config.max_trajectory_tokens
        prompt = longest_prompt_tokens([*data.train, *data.eval], self.encode, config.dataset.max_prompt_tokens)
        if not tokens and self.online is None:
            tokens = prompt + config.sampling.max_new_tokens
        if not tokens:
            self.log.info("traj_capacity_unchecked", reason="an online builder without max_trajectory_tokens")
            return 0
        evals = len(data.eval) if self.online is None else 0
        need = check_traj_capacity(traj_max_bytes=traj_cap, batch_size=config.batch_size,
                                   group_size=config.group_size, max_staleness=config.max_staleness,
                                   trajectory_tokens=tokens, eval_items=evals,
                                   eval_tokens=prompt + config.eval_max_new_tokens)
        self.log.info("traj_capacity", in_flight_bytes=need, traj_max_bytes=traj_cap, trajectory_tokens=tokens)
        return need

    # issuing ------------------------------------------------------------------------------------------
    @property
    def train_target_reached(self) -> bool:
        total = self.config.total_steps
        return bool(total) and self.budget.accepted + self.budget.in_flight >= total * self.config.batch_size

    async def issue_loop(self, stop: asyncio.Event) -> None:
        if self.online is not None:
            await self.publish_budget()
            return
        first = self.evals.rounds.get(0) or await self.issue_eval(self.budget.version)
        while not first.complete and not stop.is_set():
            await self.wait_changed()
        while not stop.is_set() and not self.finished.is_set():
            if not await self.issue_once():
                await self.wait_changed()

    async def wait_changed(self, timeout: float = 1.0) -> None:
        """Sleep until a trajectory, version or control call changes what may be issued (or `timeout`)."""
        self.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout=timeout)

    async def issue_once(self) -> bool:
        version = self.budget.version
        total = self.config.total_steps
        if total and self.batches_published >= total and version >= total and self.deployed_version >= total:
            if self.run_end.final_round is None and not self.evals.pending:
                self.run_end.final_round = await self.issue_eval(version, final=True)
            return False
        if self.evals.due(version) and self.deployed_version >= version and not self.evals.pending:
            await self.issue_eval(version)
            return True
        if self.unpublished:
            await self._publish_works(self.unpublished)
            return True
        chunk = self._reserve(ISSUE_CHUNK)
        if not chunk:
            CAPACITY.set(self.budget.capacity())
            return False
        start = self.issued
        works = [self._train_work(task, start + i, version) for i, (task, _) in enumerate(chunk)]
        # counted as issued (in memory, then in the ledger, once for the chunk) before they are published: their
        # trajectories can reach handle_group before the PubAcks do (a lost PubAck, a retry), and must find them
        # issued; a restarted builder publishes the ledger's last chunk again (deduplicated where it was)
        self.issued += len(chunk)
        try:
            await self.ledger.set_issued(self.issued, self.budget.refills, chunk_start=start)
        except BaseException:
            # nothing published: the same tasks get the same ids next time (rewriting the count if it was stored)
            self.issued = start
            self.train = itertools.chain([task for task, _ in chunk], self.train)
            for _, refilled in reversed(chunk):
                self.budget.cancel_issue(refilled=refilled)
            raise
        ISSUED.inc(len(chunk))
        EXTRA_PROMPTS.inc(sum(refilled for _, refilled in chunk))
        issued_at = time.monotonic()
        for work in works:
            self.in_flight_since[work[0].group_id if isinstance(work, list) else work.group_id] = issued_at
        await self._publish_works(works)
        return True

    def _reserve(self, most: int) -> list[tuple[object, bool]]:
        """Up to `most` tasks the budget admits now, each with whether it is a refill (the slot of a filtered
        group): one ledger write and one burst of publishes for all of them."""
        chunk: list[tuple[object, bool]] = []
        while len(chunk) < most and self.admitting.is_set() and not self.train_target_reached:
            refills = self.budget.refills
            if not self.budget.try_issue():
                break
            chunk.append((next(self.train), self.budget.refills > refills))
        return chunk

    def _train_work(self, task, n: int, version: int) -> data_pb2.PromptWork | list[data_pb2.Trajectory]:
        group_id = f"g-{n}"  # the n-th task of the seeded stream: re-issuing after a crash is idempotent
        if task.is_pair:      # a preference row: its pair goes straight to the scored trajectories, as one group
            if self.encode_reply is None:
                raise FieldError("dataset.preference", "this builder was started without a reply encoder")
            return make_pair(task, group_id=group_id, encode=self.encode, encode_reply=self.encode_reply,
                             sampling=self.train_sampling, issued_at=now())
        return make_work(task, work_id=group_id, group_id=group_id, group_size=self.config.group_size,
                         encode=self.encode, sampling=self.train_sampling, version=version, split="train",
                         issued_at=now())

    async def _publish_works(self, works: list[data_pb2.PromptWork | list[data_pb2.Trajectory]]) -> None:
        """Publish counted works, all at once (their PubAcks come back together); those that fail stay counted
        and are published first by the next issue_once (or by a restarted builder's recovery: this failure ends
        the issue loop, and with it the builder)."""
        self.unpublished = list(works)
        results = await asyncio.gather(*(self._publish_work(w) for w in works), return_exceptions=True)
        self.unpublished = [w for w, r in zip(works, results, strict=True) if isinstance(r, BaseException)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def _publish_work(self, work: data_pb2.PromptWork | list[data_pb2.Trajectory]) -> None:
        await self._store_images(work)
        if isinstance(work, list):   # the ids dedupe a republished pair
            await trajectory_groups.publish(self.bus, SUBJECT_TRAJ_SCORED, work)
        else:
            await self.bus.publish(SUBJECT_PROMPTS, work, work.work_id)

    async def _store_images(self, work: data_pb2.PromptWork | list[data_pb2.Trajectory]) -> None:
        """The images a work names, in the object store before the work is published (each stored once)."""
        for ref in work.images if isinstance(work, data_pb2.PromptWork) else ():
            await self.images.put(self.image_blobs[ref.sha256])

    async def issue_eval(self, version: int, *, final: bool = False) -> EvalRound:
        rnd = self.evals.start(version, len(self.eval_tasks), final=final)
        self.eval_since[rnd.round_id] = time.monotonic()
        await self.ledger.add_eval(IssuedEval(rnd.round_id, version, rnd.expected, final))
        await self.publish_eval_work(rnd)
        return rnd

    async def publish_eval_work(self, rnd: EvalRound) -> None:
        """The round's prompt work (again, after a restart: the ids dedupe; a late repeat is recorded once)."""
        version, final = rnd.version, rnd.final
        for i, task in enumerate(self.eval_tasks):
            work_id = f"eval-{rnd.round_id}-{i}"
            work = make_work(task, work_id=work_id, group_id=work_id, group_size=1, encode=self.encode,
                             sampling=self.eval_sampling, version=version, split="eval", issued_at=now(),
                             eval_round=rnd.round_id)
            await self._store_images(work)
            await self.bus.publish(SUBJECT_PROMPTS, work, work_id)
        self.log.info("eval_issued", round=rnd.round_id, version=version, final=final, n=rnd.expected)

    # consuming ----------------------------------------------------------------------------------------
    async def handle_scored(self, traj: data_pb2.Trajectory, msg) -> None:
        """One scored trajectory alone: a group message of one."""
        await self.handle_group(trajectory_groups.of([traj]), msg)

    async def handle_message(self, groups: list[data_pb2.TrajectoryGroup], msg) -> None:
        """A traj.scored message: a group (or some of its members), or a bundle of whole groups (the reward
        service scores a rollout's bundle together). Every member of every group is checked before any is held
        (one that can never be trained dead-letters the message, and with it each of its groups); a bundle's
        message is acked once each of its groups has been batched, dropped or, for eval results, reported."""
        if len(groups) == 1:
            await self.handle_group(groups[0], msg)
            return
        await self.live.wait()
        for group in groups:
            self._check_group(group)
        shared = SharedAck(msg, len(groups))
        for group in groups:
            await self._handle_checked(group, shared.part())

    async def handle_group(self, message: data_pb2.TrajectoryGroup, msg) -> None:
        """A group message from traj.scored (all of a group's members, or some of them when it was split): every
        member is checked before any is held; `msg` is acked once the group is batched, dropped or, for an eval
        result, its round's event is out."""
        await self.live.wait()
        self._check_group(message)
        await self._handle_checked(message, msg)

    def _check_group(self, message: data_pb2.TrajectoryGroup) -> None:
        trajs = message.trajectories
        if not trajs or not all(t.trajectory_id and t.group_id for t in trajs):
            raise InvalidMessage("trajectory_id / group_id: missing")
        for traj in trajs:
            self._check_scored(traj)

    async def _handle_checked(self, message: data_pb2.TrajectoryGroup, msg) -> None:
        trajs = list(message.trajectories)
        first = trajs[0]
        if first.split == "eval":
            for traj in trajs:
                await self._record_eval(traj, msg)
            return
        if first.group_id in self.consumed_groups:
            await msg.ack()  # a redelivery of a group already batched or dropped
            return
        group = None
        for traj in trajs:  # checked above: add cannot refuse one
            group = self.assembler.add(traj, ack=msg) or group
        if group is None:
            if len(self.assembler.ready) >= self.config.batch_size:
                await self.flush_batches()  # a failed flush left them there: this redelivery retries it
            return
        self.received += len(group.members)
        self.reward_sum += sum(t.reward for t in group.members.values())
        if first.source == "workflow":
            if group.group_id not in self.counted:
                self.counted[group.group_id] = "complete"
                self.budget.on_complete(accepted=True)
        elif self.online is not None:
            self.online.arrived += 1
        if group.group_id in self.dropping:
            return  # handle_dead_letter is writing its drop (which settles it as complete): not filtered too
        if first.source == "workflow" and self.config.dynamic_sampling and not reward_varies(group):
            await self._filter(group)
            return
        await self.flush_batches()
        self.changed.set()

    def _check_scored(self, traj: data_pb2.Trajectory) -> None:
        """InvalidMessage naming the field when this scored trajectory can never be trained or recorded."""
        if traj.source == "workflow" and traj.split == "train" and not self._issued_here(traj.group_id):
            raise InvalidMessage(f"group_id: {traj.group_id!r} was never issued by this builder")
        try:
            check_rewards(traj, self.config.max_abs_reward)
            if traj.split == "eval":
                if not traj.grading.HasField("eval_round"):
                    raise FieldError("grading.eval_round", "missing on an eval trajectory")
                return
            mismatch = temperature_mismatch(traj, self.config.sampling.temperature)
            if mismatch:
                raise InvalidMessage(mismatch)
            check_step_rewards(traj)
            check_group_size(traj)
        except ValueError as exc:
            raise InvalidMessage(str(exc)) from exc

    async def _filter(self, group: Group) -> None:
        """Dynamic sampling: a workflow group of equal rewards never reaches a batch; it is recorded like a
        dropped group (before its messages are acked) and its budget slot goes to an extra prompt."""
        self.assembler.forget(group.group_id)  # before any await: no concurrent flush may batch it
        await self.ledger.add_dropped(Dropped(group.group_id, NO_VARIANCE, "workflow", len(group.members)))
        await self._retire(group)
        if self.counted.get(group.group_id) != "filtered":
            self.counted[group.group_id] = "filtered"
            self.budget.on_filtered()
            GROUPS_FILTERED.inc()
        self.changed.set()

    async def flush_batches(self) -> None:
        async with self.flush_lock:
            await self._flush_batches()

    async def _flush_batches(self) -> None:
        total = self.config.total_steps
        released = 0
        while len(self.assembler.ready) >= self.config.batch_size and not (total and self.batches_published >= total):
            index = self.batches_published
            result = assemble_batch(self.assembler.ready, batch_size=self.config.batch_size, index=index,
                                    max_staleness=self.config.max_staleness, batch_id=f"batch-{index}",
                                    created_at=now())
            unsettled = [*result.stale, *result.groups]  # popped from `ready`, neither dropped nor published yet
            try:
                for group in result.stale:
                    if await self._drop(group, "stale"):
                        released += 1
                    unsettled.remove(group)
                if result.batch is None:
                    break
                result.batch.group_ids.extend(g.group_id for g in result.groups)
                await publish_batch(self.bus, result.batch)
            except BatchConflict as exc:  # another builder wrote this index: stop; a restart recovers past it
                self.assembler.ready.extendleft(reversed(unsettled))
                self.fail(exc)
                raise
            except BaseException:
                # back to the front, in order: the next flush (the failed message's redelivery) builds this index
                # from the same groups, so a batch stored before its PubAck was lost is republished the same
                # (deduplicated). Only their messages' acks say they were handled, and those were not sent.
                self.assembler.ready.extendleft(reversed(unsettled))
                raise
            await self._published(result.batch, result.groups, len(result.stale))
        if released and self.online is not None:
            await self.publish_budget()

    async def _published(self, batch: data_pb2.TrainingBatch, groups: list[Group], stale: int) -> None:
        """Batch `batch.index` is on the stream: count it and ack its groups, then record it in the ledger (which
        outlasts the stream's limits; until it is written, the stream is the record)."""
        self.batches_published = batch.index + 1
        BATCHES.inc()
        for group in groups:
            await self._retire(group)
        self.log.info("batch_published", index=batch.index, groups=len(groups), stale_dropped=stale)
        await self.ledger.add_batch(Batched(batch.index, tuple(batch.group_ids), len(batch.trajectories)))

    async def _drop(self, group: Group, reason: str, source: str = "") -> bool:
        """Record the group as never to be trained (durably, before its messages are acked); True: online."""
        source = source or (next(iter(group.members.values())).source if group.members else "workflow")
        await self.ledger.add_dropped(Dropped(group.group_id, reason, source, len(group.members)))
        await self._retire(group)
        self.groups_dropped += 1
        self.dropped_stale += len(group.members)
        DROPPED.inc(len(group.members))
        if source == "workflow":
            if group.complete:
                self.budget.on_unaccept()
            else:
                self.budget.on_complete(accepted=False)
            return False
        if self.online is not None:
            self.online.released += 1
        return True

    async def handle_dead_letter(self, letter: data_pb2.DeadLetter) -> None:
        """A prompt work or trajectory that no service could process: its group can never complete, so it is
        dropped with the reason (its budget slot freed); an eval result counts as wrong."""
        await self.live.wait()
        groups: dict[str, list] = {}   # a rollout's bundle holds several groups: each is dropped
        for each in trajectory_groups.dead_letter_items(letter):  # none when undecodable: it never had a group
            groups.setdefault(each.group_id, []).append(each)
        for items in groups.values():
            await self._dead_lettered(letter, items)

    async def _dead_lettered(self, letter: data_pb2.DeadLetter, items: list) -> None:
        item = items[0]
        if not item.group_id or item.group_id in self.consumed_groups:
            return
        source = getattr(item, "source", "") or "workflow"
        if source == "workflow" and item.split == "train" and not self._issued_here(item.group_id):
            return  # not this builder's (its own "never issued" letters): no slot of the budget to free
        reason = f"dead_letter:{letter.consumer}"
        if item.split == "eval":
            for each in items:
                rnd = self.evals.record(grading.eval_round(each.grading), each.task_id, 0.0, [])
                if rnd is not None:
                    await self._finish_eval(rnd)
            return
        async with self.flush_lock:
            # still tracked until the drop is recorded (_drop retires it): a retry after a failed write
            # (follow() hands the letter again) finds the group with its members and acks
            group = self.assembler.known.get(item.group_id) or Group(item.group_id, item.group_size)
            self.dropping.add(item.group_id)
            try:
                online = await self._drop(group, reason, source)
            finally:
                self.dropping.discard(item.group_id)
        self.log.warning("group_dropped", group_id=item.group_id, reason=reason)
        if online and self.online is not None:
            await self.publish_budget()
        self.changed.set()

    async def publish_budget(self) -> None:
        """Announce the online budget; a failed publish is only logged (the next one carries the same totals)."""
        b = self.online
        event = data_pb2.VersionEvent(event_id=b.event_id, version=b.version, kind=data_pb2.VERSION_KIND_BUDGET,
                                      at=now(), metrics=b.metrics(), budget=b.to_proto())
        try:
            await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        except Exception as exc:
            self.log.warning("budget_publish_failed", event_id=event.event_id, error=str(exc))
            return
        GATEWAY_LIMIT.set(b.limit + b.released)

    async def _retire(self, group: Group) -> None:
        self.consumed_groups.add(group.group_id)
        self.in_flight_since.pop(group.group_id, None)
        self.assembler.forget(group.group_id)
        for msg in group.acks:
            with contextlib.suppress(Exception):
                await msg.ack()

    def _issued_here(self, group_id: str) -> bool:
        n = group_id.removeprefix("g-")
        return n.isdigit() and int(n) < self.issued

    async def _record_eval(self, traj: data_pb2.Trajectory, msg) -> None:
        round_id = traj.grading.eval_round
        known = self.evals.rounds.get(round_id)
        if known is None or known.complete:
            await msg.ack()  # a late repeat, or a round this run never issued
            return
        self.eval_acks.setdefault(round_id, []).append(msg)  # held until the round's event is published
        rnd = self.evals.record(round_id, traj.task_id, traj.reward, list(traj.versions))
        if rnd is not None:
            await self._finish_eval(rnd)

    async def _finish_eval(self, rnd: EvalRound) -> None:
        self.changed.set()
        versions = sorted(rnd.token_versions) or [rnd.version]
        event = data_pb2.VersionEvent(
            event_id=f"eval-{rnd.round_id}", version=rnd.version, kind=data_pb2.VERSION_KIND_EVAL, at=now(),
            metrics={"accuracy": rnd.accuracy, "n": float(len(rnd.rewards)), "final": float(rnd.final),
                     "min_token_version": float(versions[0]), "max_token_version": float(versions[-1])})
        await self.bus.publish(SUBJECT_VERSIONS, event, event.event_id)
        self.log.info("eval_done", round=rnd.round_id, version=rnd.version, accuracy=rnd.accuracy, final=rnd.final)
        if rnd.final:
            await self._publish_run_end(rnd.version, {"eval_accuracy": rnd.accuracy})
        for held in self.eval_acks.pop(rnd.round_id, []):
            with contextlib.suppress(Exception):
                await held.ack()

    async def _publish_run_end(self, version: int, metrics: dict[str, float]) -> None:
        """RUN_END, once the trainer's final checkpoint is out (what stops `make run`'s stack: a final/ still
        being written would be cut off), or `final_checkpoint_timeout_s` after asking, whichever comes first."""
        self.run_end.ask(version, metrics, time.monotonic())
        await self._end_when_checkpointed()

    async def _end_when_checkpointed(self) -> None:
        due = self.run_end.due(time.monotonic())
        if due is None:
            return
        version, metrics, checkpointed = due
        if not checkpointed:
            self.log.warning("run_end_without_final_checkpoint", waited_s=round(self.run_end.waited(time.monotonic()), 1))
        end = data_pb2.VersionEvent(event_id="run-end", version=version, kind=data_pb2.VERSION_KIND_RUN_END,
                                    at=now(), metrics=metrics)
        await self.bus.publish(SUBJECT_VERSIONS, end, end.event_id)
        self.run_end.seen = True
        self.finished.set()

    async def handle_version(self, event: data_pb2.VersionEvent) -> None:
        """Every event of the run, replayed from the stream's start at each (re)start: idempotent, and it
        publishes nothing until the replay is done (`live`)."""
        live = self.live.is_set()
        if event.kind == data_pb2.VERSION_KIND_TRAINED:
            self.budget.on_version(event.version)
            if live:
                await self._end_online_run()
        elif event.kind == data_pb2.VERSION_KIND_DEPLOYED:
            self.deployed_version = max(self.deployed_version, event.version)
            if self.online is not None:  # new agent groups sample at the deployed version, not the trained one
                self.online.on_version(event.version)
                if live:
                    await self.publish_budget()
        elif event.kind == data_pb2.VERSION_KIND_EVAL and event.event_id.startswith("eval-"):
            self.evals.close(int(event.event_id.removeprefix("eval-")))
        elif event.kind == data_pb2.VERSION_KIND_RUN_END:
            self.run_end.seen = True
            self.finished.set()
        elif event.kind == data_pb2.VERSION_KIND_CHECKPOINT:
            self.checkpoints = sorted({*self.checkpoints, event.version})[-CHECKPOINTS_KEPT:]
            self.run_end.checkpointed |= pathlib.PurePath(event.checkpoint_path).name == "final"
            if live:
                await self.prune_blobs()
                await self._end_when_checkpointed()
        self.changed.set()

    async def prune_blobs(self) -> None:
        """Delete the blobs of batches no trainer reads again: a restarted trainer resumes from one of its
        CHECKPOINTS_KEPT newest checkpoints, at version v, and reads batches from index v on."""
        if len(self.checkpoints) < CHECKPOINTS_KEPT or self.checkpoints[0] <= self.blobs_pruned_below:
            return
        below = self.checkpoints[0]
        gone = await prune_blobs(self.bus, below)
        self.blobs_pruned_below = below
        if gone:
            get_logger().info("blobs_pruned", below=below, deleted=gone)

    async def _end_online_run(self) -> None:
        total = self.config.total_steps
        if self.config.source == "online" and total and self.budget.version >= total and not self.finished.is_set():
            await self._publish_run_end(self.budget.version, {})

    async def recover(self, stop: asyncio.Event) -> None:
        """Rebuild the state a previous builder process left: replay EVENTS (versions, finished evals, run end),
        read the ledger (issued, dropped, batched groups, issued evals) and BATCHES (a batch not yet recorded). Scored
        trajectories it held unacked come back by redelivery and complete their groups again."""
        await self.ledger.open()
        caught_up = asyncio.Event()
        self._follower = asyncio.create_task(follow(self.bus, SUBJECT_VERSIONS, decoder(data_pb2.VersionEvent),
                                                    self.handle_version, stop, caught_up=caught_up))
        await wait_either(caught_up, stop)
        ledger = await self.ledger.load()
        batches = merge_batches(ledger.batches, await published_batches(self.bus)).values()
        counts = recount(ledger, batches)
        self.batches_published, self.consumed_groups = counts.batches_published, set(counts.consumed_groups)
        self.received, self.dropped_stale, self.groups_dropped = counts.received, counts.dropped_stale, \
            counts.groups_dropped
        if self.online is None:
            self.issued = counts.issued
            counts.restore(self.budget)
            restarted = time.monotonic()  # their clocks start again: the deadline counts from this recovery
            self.in_flight_since = dict.fromkeys(counts.open_groups(), restarted)
            start = min(ledger.chunk_start, self.issued)
            self.train = itertools.islice(self.train, start, None)
            last_chunk = [(n, next(self.train)) for n in range(start, self.issued)]
            # counted before their publishes, which may not have happened: again (deduplicated where they did)
            await self._publish_works([self._train_work(task, n, self.budget.version) for n, task in last_chunk
                                       if f"g-{n}" not in self.consumed_groups])
        else:
            counts.restore_online(self.online)
        for r in sorted(ledger.evals.values(), key=lambda r: r.round_id):
            rnd = self.evals.restore(r.round_id, r.version, r.expected, final=r.final)
            self.eval_since[r.round_id] = time.monotonic()
            if r.final:
                self.run_end.final_round = rnd
        reopened = [r for r in self.evals.rounds.values() if not r.complete]
        for rnd in reopened:
            await self.publish_eval_work(rnd)
        if self.run_end.interrupted():
            await self._publish_run_end(self.run_end.final_round.version, {})  # the crash came between the two events
        self.live.set()
        self.changed.set()
        self.log.info("recovered", version=self.budget.version, deployed=self.deployed_version,
                      batches=self.batches_published, issued=self.issued, dropped_groups=len(ledger.dropped),
                      in_flight=self.budget.in_flight, eval_rounds=len(self.evals.rounds), reopened_evals=len(reopened),
                      finished=self.finished.is_set())
        await self._end_online_run()

    async def keep_alive(self, stop: asyncio.Event) -> None:
        """Tell JetStream the scored trajectories held in open groups and eval rounds are still being worked on
        (so they are not redelivered while this builder lives, and are soon after it dies)."""
        every = (self.bus.ack_wait or CONSUMERS["builder"].ack_wait) / 3
        ticks = 0
        while not stop.is_set():
            ticks += 1
            await sleep_or_stop(stop, every)
            for msg in [*self.assembler.held(), *(m for ms in self.eval_acks.values() for m in ms)]:
                with contextlib.suppress(Exception):
                    await msg.in_progress()
            if self.live.is_set() and not stop.is_set():
                await self.drop_expired(time.monotonic())
                await self._end_when_checkpointed()
                if ticks % 10 == 0:
                    with contextlib.suppress(*TRANSIENT):
                        await self.check_traj()

    async def check_traj(self) -> int:
        """Messages TRAJ discarded (over its byte cap: limits retention drops the oldest, acked or not) above the
        builder's ack floor: trajectories not yet batched, or raw ones not yet scored. Said loudly, never silent;
        their groups then time out (`drop_expired`)."""
        info = await self.bus.js.stream_info("TRAJ")
        floor = (await self.bus.js.consumer_info("TRAJ", "builder")).ack_floor.stream_seq or 0
        lost = max(0, info.state.first_seq - 1 - floor)
        if lost > self.traj_discarded:
            TRAJ_DISCARDED.set(lost)
            self.log.error("traj_discarded", messages=lost, first_seq=info.state.first_seq, ack_floor=floor,
                           bytes=info.state.bytes, max_bytes=info.config.max_bytes,
                           reason="TRAJ is over its byte cap (30% of nats_max_bytes) with trajectories in flight: "
                                  "raise nats_max_bytes; the groups they belonged to are dropped as timeout")
            self.traj_discarded = lost
        return lost

    async def drop_expired(self, at: float) -> int:
        """Drop ("timeout") every issued group still incomplete `group_timeout_s` after its issue: a trajectory
        that will never come (TRAJ over its byte cap discarded it, a work item lost) would otherwise hold its
        budget slot forever and, with enough of them, stall the run. A member arriving later is acked as a
        duplicate of a dropped group."""
        dropped = 0
        for group_id, since in list(self.in_flight_since.items()):
            group = self.assembler.known.get(group_id)
            if at - since < self.config.group_timeout_s or (group is not None and group.complete):
                continue
            if group_id in self.consumed_groups:
                self.in_flight_since.pop(group_id, None)
                continue
            got = len(group.members) if group is not None else 0
            self.log.warning("group_timeout", group_id=group_id, members=got, size=self.config.group_size,
                             waited_s=round(at - since, 1))
            await self._drop(group or Group(group_id, self.config.group_size), "timeout", source="workflow")
            dropped += 1
        for round_id, since in list(self.eval_since.items()):
            if at - since < self.config.group_timeout_s:
                continue
            del self.eval_since[round_id]
            rnd = self.evals.expire(round_id)
            if rnd is not None:  # else complete already
                self.log.warning("eval_timeout", round=round_id, missing=sum(k.startswith("missing-") for k in rnd.rewards),
                                 reason="its missing results count as wrong")
                await self._finish_eval(rnd)
        return dropped

    def fail(self, exc: BaseException) -> None:
        """An error found inside a message handler that must take the service down (the consumer would only nak)."""
        if self.failure is None:
            self.failure = exc
            self.failed.set()

    async def fail_fast(self, stop: asyncio.Event) -> None:
        await wait_either(self.failed, stop)
        if self.failure is not None:
            raise self.failure

    async def run(self, stop: asyncio.Event) -> None:
        await self.recover(stop)
        if stop.is_set():
            return
        await self.prune_blobs()  # what the replayed checkpoints allow
        tasks = [
            asyncio.create_task(consume(self.bus, "builder", trajectory_groups.decode_groups, self.handle_message, stop,
                                        concurrency=64, manual_ack=True), name="scored"),
            asyncio.create_task(self.issue_loop(stop), name="issue"),
            asyncio.create_task(self.keep_alive(stop), name="keep-alive"),
            asyncio.create_task(self.fail_fast(stop), name="fail-fast"),
            asyncio.create_task(self.dead_letters.run(stop), name="dead-letter-counts"),
            asyncio.create_task(follow(self.bus, "dlq.>", decoder(data_pb2.DeadLetter), self.handle_dead_letter, stop,
                                       stream="DLQ"), name="dead-letters"),
            self._follower,
        ]
        supervise(tasks, stop)
        await asyncio.gather(*tasks)

    def start(self, stop: asyncio.Event) -> list[asyncio.Task]:
        """The builder: recovery, then its loops (version events, scored trajectories, issuing, keep-alive)."""
        return [asyncio.create_task(self.run(stop), name="builder")]

    def status(self) -> builder_pb2.BuilderStatus:
        b = self.budget
        return builder_pb2.BuilderStatus(
            policy_version=b.version, max_staleness=b.max_staleness, batch_size=b.batch_size,
            groups_issued=self.issued, groups_in_flight=b.in_flight, groups_accepted=b.accepted,
            batches_published=self.batches_published, trajectories_received=self.received,
            trajectories_dropped_stale=self.dropped_stale, capacity=b.capacity(),
            paused=not self.admitting.is_set(), mean_reward=self.reward_sum / self.received if self.received else 0.0,
            dead_letters=self.dead_letters.counts, dead_lettered=sum(self.dead_letters.counts.values()),
            groups_dropped=self.groups_dropped, groups_filtered=b.filtered, extra_prompts_issued=b.refills)


class BuilderServicer(builder_pb2_grpc.BuilderServiceServicer):
    def __init__(self, builder: Builder) -> None:
        self.b = builder

    async def Status(self, request, context):
        return self.b.status()

    async def Pause(self, request, context):
        self.b.admitting.clear()
        return common_pb2.Ack(ok=True, message="admission paused")

    async def Resume(self, request, context):
        self.b.admitting.set()
        self.b.changed.set()
        return common_pb2.Ack(ok=True, message="admission resumed")


def _processor(model_path: str):
    """A vision-language model's processor (its chat template and image placeholders). Imported here: transformers'
    processing module pulls in its modeling code (~2 CPU-s at every builder start) that a text policy never needs."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_path)


async def serve(config: BuilderConfig, stop: asyncio.Event) -> None:
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    processor = _processor(config.model_path) if is_vision_language(config.model_path) else None
    encode = config.dataset.encoder(tokenizer, processor)
    async with ServiceRuntime(config, stop) as runtime:
        bus = await runtime.connect_bus("builder")
        # a second builder waits here, as a standby, until the active one's lease is released or lapses
        if await runtime.hold_lease(bus, "builder") is None:
            return
        builder = Builder(config, bus, encode, [tokenizer.eos_token_id],
                          encode_reply=lambda text: tokenizer.encode(text, add_special_tokens=False))
        rpc = await runtime.serve_grpc([Servicer(
            builder_pb2_grpc.add_BuilderServiceServicer_to_server, BuilderServicer(builder),
            builder_pb2.DESCRIPTOR.services_by_name["BuilderService"].full_name)])
        get_logger().info("serving", grpc_port=rpc.port, batch_size=config.batch_size, eta=config.max_staleness)
        for task in builder.start(stop):
            runtime.adopt(task)
        await runtime.until_stopped()
