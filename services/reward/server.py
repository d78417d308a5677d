"""The reward service's edges: a queue-group consumer on traj.raw (a group, or a rollout's bundle of groups, per
message), publishes a message's groups scored together on traj.scored, serves gRPC."""

from __future__ import annotations

import asyncio

import grpc
import prometheus_client
from transformers import AutoTokenizer

from services.common import grading, trajectory_groups
from services.common.bus import SUBJECT_TRAJ_SCORED, Bus, consume
from services.common.contracts import data_pb2, reward_pb2, reward_pb2_grpc
from services.common.deadletters import DeadLetterWatch
from services.common.errors import FieldError, field_error
from services.common.logging import get_logger
from services.common.rpc import Servicer, invalid_argument
from services.common.runtime import ServiceRuntime
from services.reward import sandbox
from services.reward.config import RewardConfig
from services.reward.scoring import Scorer
from services.reward.verifiers import build_verifier, judge, verifier_names

SCORED = prometheus_client.Counter("meshrl_reward_scored_total", "Trajectories scored")
REWARD = prometheus_client.Summary("meshrl_reward_value", "Rewards given")
RUNS = prometheus_client.Counter("meshrl_reward_code_runs_total", "Agents' programs run in the sandbox", ["status"])
MAX_CODE_BYTES = 1 << 20


def check_run_code(request: reward_pb2.RunCodeRequest, max_timeout_s: float) -> None:
    """FieldError naming what a RunCode request may not carry."""
    if not request.code.strip():
        raise FieldError("code", "empty")
    if len(request.code.encode()) > MAX_CODE_BYTES or len(request.stdin) > MAX_CODE_BYTES:
        raise FieldError("code" if len(request.code.encode()) > MAX_CODE_BYTES else "stdin",
                         f"over {MAX_CODE_BYTES} bytes")
    if request.timeout_s < 0 or request.timeout_s > max_timeout_s:
        raise FieldError("timeout_s", f"must be in (0, {max_timeout_s:g}] (the sandbox's limit), or unset; "
                                      f"got {request.timeout_s:g}")


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, scorer: Scorer, stats: dict[str, float], dead_letters: DeadLetterWatch,
                 sandbox_config: sandbox.SandboxConfig) -> None:
        self.scorer = scorer
        self.sandbox_config = sandbox_config
        self.stats = stats
        self.dead_letters = dead_letters

    async def Score(self, request, context):
        try:
            task = grading.to_task(request.grading)
            verdict = await self.scorer.score_text_async(request.verifier, request.response, task)
        except ValueError as exc:  # it names the field: verifier, grading.<key>...
            await invalid_argument(context, field_error(exc) or FieldError("grading", str(exc)))
        return reward_pb2.ScoreReply(reward=verdict.reward, detail=verdict.detail)

    async def RunCode(self, request, context):
        """An agent's tool call in the code verifiers' own sandbox (never unsandboxed: no bwrap, no run)."""
        try:
            limits = self.sandbox_config.limits
            check_run_code(request, limits.timeout_s)
            box = await asyncio.to_thread(sandbox.shared_sandbox)
            result = await box.run_async(request.code, request.stdin, request.language or "python",
                                         request.timeout_s or None)
        except ValueError as exc:
            await invalid_argument(context, field_error(exc) or FieldError("code", str(exc)))
        except sandbox.SandboxUnavailable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except RuntimeError as exc:  # every slot busy past the sandbox's wait: the caller may retry
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        RUNS.labels(result.status).inc()
        return reward_pb2.RunCodeReply(status=result.status, exit_code=result.exit_code, stdout=result.stdout,
                                       stderr=result.stderr, wall_seconds=result.wall_seconds,
                                       truncated=result.truncated)

    async def ListVerifiers(self, request, context):
        """Built-ins, `reasoning_gym:<family>` for every reasoning-gym family, and installed plugins."""
        return reward_pb2.ListVerifiersReply(verifiers=await asyncio.to_thread(verifier_names))

    async def Status(self, request, context):
        n = self.stats["scored"]
        counts = self.dead_letters.counts
        return reward_pb2.RewardStatus(scored=int(n), mean_reward=self.stats["reward_sum"] / n if n else 0.0,
                                       dead_letters=counts, dead_lettered=counts.get("reward", 0))


async def score_groups(scorer: Scorer, bus: Bus, groups: list[data_pb2.TrajectoryGroup]) -> list[data_pb2.Trajectory]:
    """One traj.raw message's groups (a rollout's bundle holds several): every member of every group is checked
    before any is scored (InvalidMessage naming it dead-letters the message), then they go on scored together on
    traj.scored (one group as its TrajectoryGroup, several as a bundle), each message's id its members' digest."""
    scored = await scorer.score_group_async([t for g in groups for t in g.trajectories])
    parts, start = [], 0
    for group in groups:
        parts.append(scored[start:start + len(group.trajectories)])
        start += len(group.trajectories)
    await trajectory_groups.publish_together(bus, SUBJECT_TRAJ_SCORED, parts)
    return scored


async def serve(config: RewardConfig, stop: asyncio.Event) -> None:
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    build_verifier(config.default_verifier, "default_verifier")  # a misspelt default stops start-up
    sandbox.configure(config.sandbox)  # code verifiers check bwrap when first built, never run unsandboxed
    judge.configure(config.judge)  # llm_judge's endpoint; reads the API key now (a missing key file stops start-up)
    async with ServiceRuntime(config, stop) as runtime:
        pool = config.verifier_pool.build()
        runtime.on_close(pool.close)   # after the bus: no trajectory is being scored any more
        bus = await runtime.connect_bus("reward")
        await _serve(config, tokenizer, pool, bus, runtime)


async def _serve(config: RewardConfig, tokenizer, pool, bus: Bus, runtime: ServiceRuntime) -> None:
    scorer = Scorer(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), config.default_verifier,
                    timeout_s=config.verifier_pool.timeout_s, pool=pool,
                    count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    stats = {"scored": 0.0, "reward_sum": 0.0}

    async def handle(groups: list[data_pb2.TrajectoryGroup]) -> None:
        scored = await score_groups(scorer, bus, groups)
        stats["scored"] += len(scored)
        stats["reward_sum"] += sum(t.reward for t in scored)
        SCORED.inc(len(scored))
        for t in scored:
            REWARD.observe(t.reward)

    dead_letters = DeadLetterWatch(bus)
    servicer = RewardServicer(scorer, stats, dead_letters, config.sandbox)
    rpc = await runtime.serve_grpc([Servicer(
        reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer,
        reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name)])
    get_logger().info("serving", grpc_port=rpc.port)
    runtime.spawn(dead_letters.run(runtime.stop), "dead-letter-counts")
    await consume(bus, "reward", trajectory_groups.decode_groups, handle, runtime.stop,
                  concurrency=config.concurrency)
