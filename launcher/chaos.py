"""`make chaos`: a shortened run during which services (and nats-server) are SIGKILLed at moments chosen by a
seed; the supervisor restarts them; afterwards the run's invariant is checked (`launcher.audit`) and written
to runs/<name>/chaos.json. Exits non-zero when the invariant does not hold.

`fill`: TRAJ is filled to that fraction of its byte cap (nats_max_bytes' share) before the first kill, with
messages on a subject no consumer reads (a long run's old, consumed trajectories), so the run's own trajectories
push it past its cap; `churn`: and filler keeps coming at that many bytes a second, so the stream turns over while
the run's trajectories are in flight (TRAJ discards the oldest message, acked or not: finding F4).

`standby`: a second instance of the single-active services named (builder, weight_exchange) runs beside the
first from the start (whichever takes the lease first serves); a kill of such a service hits whichever instance is active then (the other one takes over,
the killed one comes back as the standby).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import random
import threading
import time

from launcher.audit import audit_run
from launcher.shutdown import SHUTDOWN
from launcher.stack import SERVICES, Stack, health_check, lease_events, run
from services.common.credentials import LEASED
from services.common.errors import FieldError

TARGETS = (*SERVICES, "nats")
# a trainer rank group's second rank (a megatron or fsdp2 trainer with `ranks` > 1): killed alone, it fails rank 0
# at its next collective or heartbeat, and the supervisor restarts the whole group from the newest checkpoint
TRAINER_RANK = "trainer-rank1"
KNOWN_TARGETS = (*TARGETS, TRAINER_RANK)


@dataclasses.dataclass(frozen=True)
class Kill:
    service: str
    at_version: int      # kill once the trainer announced this version...
    delay: float         # ...and this many seconds more


def schedule(seed: int, total_steps: int, *, kills: int | None = None,
             services: tuple[str, ...] = TARGETS) -> list[Kill]:
    """`kills` kills (default: one per service) at seeded versions inside the run; every service in `services`
    is hit at least once when kills >= len(services)."""
    for s in services:
        if s not in KNOWN_TARGETS:
            raise FieldError("services", f"unknown {s!r} (known: {', '.join(KNOWN_TARGETS)})")
    if not services:
        raise FieldError("services", "empty")
    n = len(services) if kills is None else kills
    if n < 0:
        raise FieldError("kills", f"must be >= 0, got {n}")
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < n:
        batch = list(services)
        rng.shuffle(batch)
        order.extend(batch)
    lo, hi = 1, max(2, total_steps - 2)
    versions = sorted(rng.randint(lo, hi) for _ in range(n))
    return [Kill(s, v, round(rng.uniform(0.0, 1.5), 2)) for s, v in zip(order[:n], versions, strict=True)]


class Killer(threading.Thread):
    """Carries out a schedule against a running stack; records what it killed and when."""

    def __init__(self, stack: Stack, events, plan: list[Kill], started: float, *, settle_timeout: float = 180.0,
                 nats_outage: float = 0.0) -> None:
        super().__init__(daemon=True, name="chaos-killer")
        self.stack = stack
        self.events = events
        self.plan = plan
        self.started = started
        self.settle_timeout = settle_timeout
        self.nats_outage = nats_outage
        self.done: list[dict] = []
        self.error = ""  # why the killer stopped early, if it failed
        self.finished = threading.Event()
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            self._kill_all()
        except Exception as exc:  # reported as a violation: a chaos run whose kills failed tested nothing
            self.error = repr(exc)
        finally:
            self.finished.set()

    def _kill_all(self) -> None:
        for kill in self.plan:
            while self.events.version < kill.at_version and not self.halt.is_set():
                time.sleep(0.1)
            if self.halt.wait(kill.delay) or SHUTDOWN.interrupted:  # the run is stopping: no more kills
                return
            target = self._victim(kill.service)
            if target is None:  # no instance became active and standby within the settle timeout
                return
            before = self.stack.restart_count(target)
            version = self.events.version
            hold = self.nats_outage if kill.service == "nats" else 0.0
            rank_alone = kill.service == TRAINER_RANK  # the supervised trainer comes back with its group
            if rank_alone:
                self.stack.kill_trainer_rank(1)
            else:
                self.stack.kill(target, hold=hold)
            record = {"service": kill.service, "wall_second": round(time.time() - self.started, 1),
                      "policy_version": version, **({"down_seconds": hold} if hold else {})}
            self.done.append(record)
            settled = self._settle("trainer" if rank_alone else kill.service, target, before)
            if kill.service in self.stack.standbys:  # which instance died, which one serves now
                record.update(instance=target, active_after=self.stack.active(kill.service), settled=settled)

    def _victim(self, service: str) -> str | None:
        """The supervised name to kill: the service (or "nats"), or with a standby its active instance, once the
        other one is known to stand by (else the kill would test nothing); for a trainer rank, the trainer (the
        supervised rank 0, which the group's failure restarts)."""
        if service == TRAINER_RANK:
            return "trainer"
        if service not in self.stack.standbys:
            return service
        deadline = time.time() + self.settle_timeout
        while time.time() < deadline and not self.halt.is_set():
            active = self._paired(service)
            if active is not None:
                return active
            time.sleep(0.2)
        return None

    def _paired(self, service: str) -> str | None:
        """The active instance of `service` when the other one stands by, else None."""
        states = {n: self.stack.lease_state(n) for n in self.stack.instances(service)}
        if sorted(states.values()) != ["active", "standby"]:
            return None
        return next(n for n, state in states.items() if state == "active")

    def _settle(self, service: str, target: str, before: int) -> bool:
        """Wait until the killed process is back (restarted, and SERVING for a service; with a standby, one
        instance active and the other standing by again)."""
        deadline = time.time() + self.settle_timeout
        while time.time() < deadline and not self.halt.is_set():
            if self.stack.restart_count(target) > before and (
                    service == "nats" or health_check(self.stack.address(service))) and (
                    service not in self.stack.standbys or self._paired(service) is not None):
                return True
            time.sleep(0.2)
        return False


FILLER_SUBJECT = "traj.filler"  # in TRAJ (traj.>), read by no consumer
FILLER_CHUNK = 64 << 10


class Filler(threading.Thread):
    """Fills TRAJ to `fraction` of its byte cap with filler, then (churn > 0) adds `churn` bytes a second until
    halted; records what it published and the stream's state."""

    def __init__(self, nats_url: str, options: dict, *, fraction: float, churn: float = 0.0) -> None:
        super().__init__(daemon=True, name="chaos-filler")
        check_fill(fraction, churn)
        self.nats_url, self.options, self.fraction, self.churn = nats_url, options, fraction, churn
        self.filled = threading.Event()
        self.halt = threading.Event()
        self.published_bytes = 0
        self.initial_bytes = 0  # what filling to `fraction` took
        self.error = ""

    def run(self) -> None:
        try:
            asyncio.run(self._run())
        except Exception as exc:  # reported; the run goes on without (more) filler
            self.error = repr(exc)
        finally:
            self.filled.set()

    async def _run(self) -> None:
        import nats

        nc = await nats.connect(servers=self.nats_url.split(","), max_reconnect_attempts=-1, **self.options)
        js, n = nc.jetstream(), 0
        chunk = b"\0" * FILLER_CHUNK
        try:
            info = await js.stream_info("TRAJ")
            if not info.config.max_bytes or info.config.max_bytes < 0:
                raise FieldError("fill", "TRAJ has no byte cap (nats_max_bytes -1)")
            while (await js.stream_info("TRAJ")).state.bytes < self.fraction * info.config.max_bytes:
                for _ in range(16):
                    n = await self._publish(js, chunk, n)
            self.filled.set()
            started = time.monotonic()
            while self.churn and not self.halt.is_set():
                if self.published_bytes - self.initial_bytes > self.churn * (time.monotonic() - started):
                    await asyncio.sleep(0.05)
                    continue
                n = await self._publish(js, chunk, n)
        finally:
            await nc.close()

    async def _publish(self, js, chunk: bytes, n: int) -> int:
        try:
            await js.publish(FILLER_SUBJECT, chunk, headers={"Nats-Msg-Id": f"filler-{n}"}, timeout=10.0)
        except Exception:  # NATS killed by the chaos: filler waits for it like any publisher
            await asyncio.sleep(0.5)
            return n
        self.published_bytes += len(chunk)
        if not self.filled.is_set():
            self.initial_bytes = self.published_bytes
        return n + 1


def check_fill(fraction: float, churn: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise FieldError("fill", f"a fraction of TRAJ's byte cap in [0, 1), got {fraction}")
    if churn < 0:
        raise FieldError("churn", f"bytes a second, >= 0, got {churn}")
    if churn and not fraction:
        raise FieldError("churn", "needs fill (the stream must be near its cap to turn over)")


async def stream_state(nats_url: str, options: dict, stream: str = "TRAJ") -> dict:
    """A stream's byte cap and what it holds after the run: `first_seq` - 1 messages were discarded (or acked off a
    work queue)."""
    import nats

    nc = await nats.connect(servers=nats_url.split(","), **options)
    try:
        info = await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()
    return {"stream": stream, "max_bytes": info.config.max_bytes, "bytes": info.state.bytes,
            "messages": info.state.messages, "first_seq": info.state.first_seq, "last_seq": info.state.last_seq,
            "discarded_messages": max(0, info.state.first_seq - 1)}


def chaos(config: str = "configs/chaos.yaml", *, seed: int = 0, kills: int | None = None,
          services: tuple[str, ...] = TARGETS, name: str = "", nats_mode: str = "single",
          runs_root: pathlib.Path | None = None, progress: bool = True, nats_outage: float = 0.0,
          model_seed: int = 0, standby: tuple[str, ...] = (), fill: float = 0.0, churn: float = 0.0) -> dict:
    """`seed` chooses the kills; `model_seed` the run's model and sampling (the built model is reused); `standby`:
    the single-active services that get a second instance once the stack serves; `fill`, `churn`: TRAJ near its
    byte cap (see the module's doc)."""
    from launcher.runconfig import RunConfig
    from launcher.stack import ROOT

    derived = RunConfig.load(config, root=ROOT).derive(seed=model_seed)  # what `run` derives from the same file
    total, eta = derived.total_steps, derived.eta
    if total < 4:
        raise FieldError("total_steps", f"a chaos run needs at least 4, got {total}")
    plan = schedule(seed, total, kills=kills, services=services)
    if TRAINER_RANK in services and derived.trainer.ranks < 2:
        raise FieldError("services", f"{TRAINER_RANK} needs a trainer of 2 or more ranks; {config} has "
                         f"{derived.trainer.ranks}")
    for service in standby:
        if service not in LEASED:
            raise FieldError("standby", f"{service!r} is not a single-active service (one of {', '.join(LEASED)})")
    check_fill(fill, churn)
    holder: dict = {}

    def on_started(stack: Stack) -> None:  # beside the first instance from the start: the kill finds it ready
        for service in standby:
            stack.start_standby(service)

    def on_healthy(stack: Stack, events) -> None:
        if fill:
            holder["filler"] = Filler(stack.nats.url, stack.nats_connect_options, fraction=fill, churn=churn)
            holder["filler"].start()
            holder["filler"].filled.wait(120)  # seconds: 19 MiB at MIN_MAX_BYTES take a few
        holder["killer"] = Killer(stack, events, plan, time.time(), nats_outage=nats_outage)
        holder["killer"].start()

    def before_stop(stack: Stack, summary: dict) -> None:
        killer: Killer | None = holder.get("killer")
        if killer is not None:
            killer.halt.set()
            killer.join(timeout=30)
        filler: Filler | None = holder.get("filler")
        if filler is not None:
            filler.halt.set()
            filler.join(timeout=30)
            holder["traj"] = {**asyncio.run(stream_state(stack.nats.url, stack.nats_connect_options)),
                              "filler_bytes": filler.published_bytes, "filler_bytes_at_start": filler.initial_bytes,
                              **({"filler_error": filler.error} if filler.error else {})}
        result = asyncio.run(audit_run(stack.nats.url, stack.run_dir, completed=bool(summary.get("completed")),
                                       total_steps=total, eta=eta, nats_options=stack.bus_options))
        holder["audit"] = result
        holder["restarts"] = dict(stack.restarts)
        holder["lease_events"] = {name: lease_events(stack.run_dir / "logs" / f"{name}.log")
                                  for service in standby for name in stack.instances(service)}

    name = name or f"chaos-seed{seed}"
    started = time.time()
    summary = run(config, name=name, seed=model_seed, runs_root=runs_root, progress=progress, nats_mode=nats_mode,
                  on_started=on_started, on_healthy=on_healthy, before_stop=before_stop)
    audit = holder.get("audit")
    killer = holder.get("killer")
    report = {
        "seed": seed,
        "model_seed": model_seed,
        "nats_mode": nats_mode,
        "nats_outage_seconds": nats_outage,
        "schedule": [dataclasses.asdict(k) for k in plan],
        "kills": killer.done if killer else [],
        "restarts": holder.get("restarts", {}),
        **({"standby": list(standby), "lease_events": holder.get("lease_events", {})} if standby else {}),
        **({"fill": fill, "churn_bytes_per_second": churn, "traj": holder.get("traj", {})} if fill else {}),
        "completed": bool(summary.get("completed")),
        "steps": len(audit.batch_indices_trained) if audit else 0,
        **({k: v for k, v in audit.to_dict().items() if k not in ("completed", "total_steps")} if audit else {}),
        "wall_seconds": summary.get("wall_seconds"),            # the stack's run, start to report
        "total_seconds": round(time.time() - started, 1),        # with the model build and the audit
        "eval_accuracy_before": summary.get("eval_accuracy_before"),
        "eval_accuracy_after": summary.get("eval_accuracy_after"),
    }
    report["violations"] = audit.violations() if audit else ["no audit: the stack did not come up"]
    if killer is not None and killer.error:
        report["violations"].append(f"the chaos killer failed: {killer.error}")
    if killer is not None and len(killer.done) < len(plan):
        report["kills_missed"] = len(plan) - len(killer.done)  # the run ended first: nothing was violated
    report["passed"] = not report["violations"]
    run_dir = (runs_root or pathlib.Path(__file__).resolve().parent.parent / "runs") / name
    (run_dir / "chaos.json").write_text(json.dumps(report, indent=2))
    return report
