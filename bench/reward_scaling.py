"""`make bench-reward`: reward throughput with 1, 2 and 4 replicas, one JSON line per case.

Each replica is a real reward service process (`python -m services.reward --config ...`); all of them pull from
the one durable consumer `reward` on `traj.raw` (one queue group) of a real nats-server started here, fresh for
each replica count. A replica's own parallelism is 1 (`concurrency` 1, one verifier-pool worker, one sandbox
slot), so N replicas are N-way parallel and nothing else.

For each replica count, for each verifier (`math`: math-verify in the pool worker; `code_tests`: human-eval style
tests run in the bwrap sandbox): a fixed backlog of raw trajectories (`--n` of code, `--n-math` of math: math is
~20x cheaper, a longer backlog keeps its window long enough to time; completion ids encoded with the reward
service's tokenizer, 1 in 4 wrong) is published to `traj.raw`, and the bench counts the unique trajectory ids that
come back on `traj.scored`.

The measured window runs from the first publish of the backlog to the last scored trajectory seen. Start-up is
outside it: the backlog is published only once every replica is SERVING (gRPC health) and has already scored one
warm-up task of that verifier through its gRPC `Score` (its math-verify worker started, its sandbox checked).
Publishing (all at once, concurrently) is inside the window; its duration is reported (`publish_seconds`).

Per case: `trajectories_per_second` and `speedup_vs_1` (against the 1-replica case of the same verifier in this
run). Where the time went: `cpu_ms_per_trajectory` (in the service processes, in sandboxed runs, in pool
workers, in nats-server, in this bench), `machine_busy_cores` (all CPU use over the window) and
`other_work_cores` (the part of it that is none of these: other work on the machine, which skews the ratios).
A last line per verifier (`case: scaling`) gives the ratios against `--target` (2 replicas vs 1).

    python -m bench.reward_scaling [--n 400] [--n-math 2000] [--replicas 1,2,4] [--verifiers math,code_tests]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import psutil
import yaml

from launcher.processes import NatsServer, free_port
from launcher.stack import ensure_model
from services.common import grading

ROOT = pathlib.Path(__file__).resolve().parents[1]


def model_path() -> pathlib.Path:
    """The tiny model whose tokenizer the reward replicas decode with (built once, ~20 s, if missing)."""
    return ensure_model("tiny-qwen3", 0)


VERIFIERS = ("math", "code_tests")
START_TIMEOUT_S = 300.0   # 4 replicas importing transformers on 2 busy cores
PER_REPLICA = {"concurrency": 1, "verifier_pool_workers": 1, "sandbox_concurrency": 1}


def line(**fields) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}), flush=True)


# the backlog ----------------------------------------------------------------------------------------------------
def math_task(i: int) -> tuple[str, dict, float]:
    """(completion, metadata, expected reward): a sum with its answer boxed; every 4th answer is off by one."""
    a, b = 3 + (i * 7) % 90, 5 + (i * 13) % 80
    wrong = i % 4 == 3
    answer = a + b + (1 if wrong else 0)
    text = f"We add the two numbers: {a} + {b} = {answer}. The answer is $\\boxed{{{answer}}}$."
    return text, {"verifier": "math", "answer": str(a + b)}, 0.0 if wrong else 1.0


def code_task(i: int) -> tuple[str, dict, float]:
    """(completion, metadata, expected reward): `add_k(x)` checked human-eval style; every 4th is wrong (its
    tests fail), every 8th of those does not even define the function."""
    k = 1 + i % 9
    body = f"    return x + {k}" if i % 4 != 3 else (f"    return x - {k}" if i % 8 != 7 else "    return x")
    name = "add_k" if i % 8 != 7 else "add_other"
    text = f"Here is the function:\n```python\ndef {name}(x):\n{body}\n```\n"
    tests = (f"def check(candidate):\n    assert candidate(1) == {1 + k}\n    assert candidate(10) == {10 + k}\n"
             f"    assert candidate(-3) == {-3 + k}\n")
    return text, {"verifier": "code_tests", "tests": tests, "entry_point": "add_k"}, 0.0 if i % 4 == 3 else 1.0


TASKS = {"math": math_task, "code_tests": code_task}


def backlog(verifier: str, n: int, tag: str, tokenizer) -> tuple[list, float]:
    """n raw trajectories (ids `bench-<tag>-<i>`) and their expected mean reward."""
    from services.common.contracts import data_pb2

    out, expected = [], 0.0
    prompt = tokenizer.encode("Solve the task.", add_special_tokens=False)
    for i in range(n):
        text, meta, reward = TASKS[verifier](i)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text, "the tokenizer must round-trip the completion"
        out.append(data_pb2.Trajectory(
            trajectory_id=f"bench-{tag}-{i}", group_id=f"bench-{tag}-g{i // 8}", task_id=f"{verifier}-{i}",
            group_size=8, prompt_ids=prompt, completion_ids=ids, behavior_logprobs=[-1.0] * len(ids),
            versions=[0] * len(ids), loss_mask=[1] * len(ids), finish_reason="stop", created_at=time.time(),
            source="workflow", grading=grading.to_proto(meta), split="train"))
        expected += reward
    return out, expected / max(1, n)


# the replicas ---------------------------------------------------------------------------------------------------
class Replica:
    def __init__(self, index: int, nats_url: str, work: pathlib.Path) -> None:
        self.index = index
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = work / f"reward-{index}.log"
        self.config_path = work / f"reward-{index}.yaml"
        self.config_path.write_text(yaml.safe_dump({
            "nats_url": nats_url, "grpc_address": self.address, "metrics_port": -1, "log_level": "warning",
            "run_dir": str(work / "run"), "model_path": str(model_path()),
            "concurrency": PER_REPLICA["concurrency"],
            "verifier_pool": {"workers": PER_REPLICA["verifier_pool_workers"]},
            "sandbox": {"concurrency": PER_REPLICA["sandbox_concurrency"]}}))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "services.reward", "--config", str(self.config_path)],
                                         cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time: the service process itself, its reaped children (sandboxed runs) and its live ones (the pool
        worker)."""
        out = {"service": 0.0, "sandbox": 0.0, "worker": 0.0}
        with contextlib.suppress(psutil.Error):
            t = self.ps.cpu_times()
            out["service"] = t.user + t.system
            out["sandbox"] = t.children_user + t.children_system
            for child in self.ps.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    c = child.cpu_times()
                    out["worker"] += c.user + c.system
        return out

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, timeout: float = 30.0) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for child in self.ps.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.kill()
            self.proc.kill()
            self.proc.wait()


async def wait_serving(replicas: list[Replica], timeout: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.rpc import channel

    deadline = time.monotonic() + timeout
    for r in replicas:
        async with channel(r.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if r.proc.poll() is not None:
                    raise RuntimeError(f"reward replica {r.index} exited with {r.proc.returncode}:\n{r.log_tail()}")
                with contextlib.suppress(Exception):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"reward replica {r.index} not SERVING after {timeout:g}s:\n{r.log_tail()}")
                await asyncio.sleep(0.2)


async def warm_up(replicas: list[Replica], verifier: str) -> None:
    """One task of `verifier` through each replica's own Score: its verifier is built (sandbox checked, math
    worker started) before the measured window."""
    from services.common.contracts import reward_pb2, reward_pb2_grpc
    from services.common.rpc import channel

    text, meta, expected = TASKS[verifier](0)

    async def one(r: Replica) -> None:
        async with channel(r.address) as ch:
            reply = await reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(verifier=verifier, response=text, grading=grading.to_proto(meta)),
                timeout=START_TIMEOUT_S)
        if reply.reward != expected:
            raise RuntimeError(f"replica {r.index}: warm-up {verifier} scored {reply.reward} ({reply.detail}), "
                               f"expected {expected}")

    await asyncio.gather(*(one(r) for r in replicas))


async def scored_counts(replicas: list[Replica]) -> list[int]:
    from services.common.contracts import common_pb2, reward_pb2_grpc
    from services.common.rpc import channel

    out = []
    for r in replicas:
        async with channel(r.address) as ch:
            status = await reward_pb2_grpc.RewardServiceStub(ch).Status(common_pb2.StatusRequest(), timeout=10.0)
        out.append(status.scored)
    return out


# one case -------------------------------------------------------------------------------------------------------
def cpu_snapshot(replicas: list[Replica], nats: NatsServer) -> dict[str, float]:
    """Cumulative CPU seconds: the replicas (service processes, sandboxed runs, pool workers), nats-server, this
    bench process, and the whole machine (every process, other work included)."""
    snap = {"service": 0.0, "sandbox": 0.0, "worker": 0.0}
    for r in replicas:
        for key, value in r.cpu_seconds().items():
            snap[key] += value
    snap["nats"], snap["bench"] = (sum(psutil.Process(pid).cpu_times()[:2]) for pid in (nats.proc.pid, os.getpid()))
    t = psutil.cpu_times()
    snap["machine"] = t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)
    return snap


async def measure(bus, replicas: list[Replica], nats: NatsServer, verifier: str, trajectories: list,
                  timeout: float) -> dict:
    from services.common import trajectory_groups
    from services.common.bus import SUBJECT_TRAJ_RAW, SUBJECT_TRAJ_SCORED

    wanted = {t.trajectory_id for t in trajectories}
    seen: dict[str, float] = {}
    first_scored: list[float] = []
    done = asyncio.Event()

    async def on_scored(msg) -> None:
        for traj in trajectory_groups.decode(msg).trajectories:
            if traj.trajectory_id in wanted and traj.trajectory_id not in seen:
                seen[traj.trajectory_id] = traj.reward
                if not first_scored:
                    first_scored.append(time.perf_counter())
                if len(seen) == len(wanted):
                    done.set()

    sub = await bus.nc.subscribe(SUBJECT_TRAJ_SCORED, cb=on_scored, pending_msgs_limit=1 << 20)
    await bus.nc.flush()
    before_scored = await scored_counts(replicas)
    cpu0 = cpu_snapshot(replicas, nats)
    t0 = time.perf_counter()
    groups: dict[str, list] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    await asyncio.gather(*(trajectory_groups.publish(bus, SUBJECT_TRAJ_RAW, members) for members in groups.values()))
    published = time.perf_counter()
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        dead = [r.index for r in replicas if r.proc.poll() is not None]
        raise RuntimeError(f"{verifier}: {len(seen)}/{len(wanted)} scored within {timeout:g}s (dead replicas: "
                           f"{dead}); dead letters: {await bus.dead_letter_counts()}") from None
    t1 = time.perf_counter()
    cpu1 = cpu_snapshot(replicas, nats)
    await sub.unsubscribe()
    after_scored = await scored_counts(replicas)
    cpu = {key: cpu1[key] - cpu0[key] for key in cpu0}
    n, wall = len(trajectories), t1 - t0
    ours = sum(cpu[k] for k in ("service", "sandbox", "worker", "nats", "bench"))
    return {"seconds": wall, "publish_seconds": published - t0, "first_scored_after_seconds": first_scored[0] - t0,
            "mean_reward": sum(seen.values()) / len(seen),
            "scored_per_replica": [a - b for a, b in zip(after_scored, before_scored, strict=True)],
            "replica_cpu_seconds": cpu["service"] + cpu["sandbox"] + cpu["worker"],
            # per trajectory: in the service processes (event loop, decode, NATS, threads), in sandboxed runs
            # (bwrap + the interpreter), in pool workers (math-verify), in nats-server and in this bench
            "cpu_ms_per_trajectory": {k: 1e3 * cpu[k] / n for k in ("service", "sandbox", "worker", "nats", "bench")},
            "machine_busy_cores": cpu["machine"] / wall,
            "other_work_cores": max(0.0, cpu["machine"] - ours) / wall}


async def run_replicas(n_replicas: int, verifiers: list[str], backlogs: dict, args, work: pathlib.Path):
    """Start a fresh nats-server and `n_replicas` replicas; yield one result per verifier."""
    from services.common.bus import Bus

    nats = NatsServer(work / "nats", log_path=work / "nats.log")
    nats.start()
    replicas: list[Replica] = []
    bus = None
    try:
        bus = await Bus.connect(nats.url, name="bench-reward", deadline=30.0)  # declares streams and the consumer
        replicas = [Replica(i, nats.url, work) for i in range(n_replicas)]
        t_start = time.perf_counter()
        await wait_serving(replicas, START_TIMEOUT_S)
        for verifier in verifiers:
            await warm_up(replicas, verifier)
        startup = time.perf_counter() - t_start
        results = []
        for verifier in verifiers:
            trajectories, expected = backlogs[verifier]
            result = await measure(bus, replicas, nats, verifier, trajectories, args.timeout)
            result.update(startup_seconds=startup, expected_mean_reward=expected)
            results.append((verifier, result))
            await asyncio.sleep(0.5)  # the last acks land before the next backlog
        return results
    finally:
        for r in replicas:
            r.terminate()
        for r in replicas:
            r.wait()
        if bus is not None:
            await bus.close()
        nats.stop()


async def main_async(args) -> None:
    from transformers import AutoTokenizer

    from services.common.logging import configure_logging

    configure_logging("bench", "error")  # stdout is the JSON lines
    tokenizer = AutoTokenizer.from_pretrained(str(model_path()))
    replica_counts = [int(x) for x in args.replicas.split(",")]
    verifiers = [v for v in args.verifiers.split(",") if v]
    for v in verifiers:
        if v not in TASKS:
            raise SystemExit(f"--verifiers: unknown {v!r} (known: {', '.join(TASKS)})")
    rates: dict[tuple[str, int], float] = {}
    sizes = {"math": args.n_math or 5 * args.n, "code_tests": args.n}
    with tempfile.TemporaryDirectory(prefix="meshrl-bench-reward-") as tmp:
        for n_replicas in replica_counts:
            work = pathlib.Path(tmp) / f"r{n_replicas}"
            work.mkdir()
            backlogs = {v: backlog(v, sizes[v], f"{v}-r{n_replicas}", tokenizer) for v in verifiers}
            for verifier, r in await run_replicas(n_replicas, verifiers, backlogs, args, work):
                rate = sizes[verifier] / r["seconds"]
                rates[(verifier, n_replicas)] = rate
                base = rates.get((verifier, 1))
                line(bench="reward_scaling", case="replicas", verifier=verifier, replicas=n_replicas,
                     trajectories=sizes[verifier], seconds=r["seconds"], trajectories_per_second=rate,
                     speedup_vs_1=rate / base if base else None, per_replica=PER_REPLICA,
                     mean_reward=r["mean_reward"], expected_mean_reward=r["expected_mean_reward"],
                     scored_per_replica=r["scored_per_replica"], publish_seconds=r["publish_seconds"],
                     first_scored_after_seconds=r["first_scored_after_seconds"],
                     replica_cpu_seconds=r["replica_cpu_seconds"],
                     cpu_ms_per_trajectory={k: round(v, 2) for k, v in r["cpu_ms_per_trajectory"].items()},
                     machine_busy_cores=r["machine_busy_cores"], other_work_cores=r["other_work_cores"],
                     machine_cores=os.cpu_count(),
                     startup_seconds=r["startup_seconds"])
    for verifier in verifiers:
        base = rates.get((verifier, 1))
        ratios = {f"speedup_{n}_vs_1": rates[(verifier, n)] / base for n in replica_counts if base and n != 1}
        two = ratios.get("speedup_2_vs_1")
        line(bench="reward_scaling", case="scaling", verifier=verifier, trajectories=sizes[verifier],
             trajectories_per_second={str(n): rates[(verifier, n)] for n in replica_counts}, **ratios,
             target_2_vs_1=args.target, target_met=None if two is None else two >= args.target)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.reward_scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="code_tests trajectories per backlog (per replica count)")
    ap.add_argument("--n-math", type=int, default=0, help="math trajectories per backlog (default: 5 x --n)")
    ap.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated (1 first: the baseline)")
    ap.add_argument("--verifiers", default=",".join(VERIFIERS))
    ap.add_argument("--target", type=float, default=1.8, help="the 2-vs-1 replica speedup the scaling line checks")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a backlog may take to be scored")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n: must be >= 1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
