"""`make chaos`: a shortened run during which services (and nats-server) are SIGKILLed at moments chosen by a
seed; the supervisor restarts them; afterwards the run's invariant is checked (`launcher.audit`) and written
to runs/<name>/chaos.json. Exits non-zero when the invariant does not hold.
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
from launcher.stack import SERVICES, Stack, health_check, run

TARGETS = (*SERVICES, "nats")


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
        if s not in TARGETS:
            raise ValueError(f"services: unknown {s!r} (known: {', '.join(TARGETS)})")
    if not services:
        raise ValueError("services: empty")
    n = len(services) if kills is None else kills
    if n < 0:
        raise ValueError(f"kills: must be >= 0, got {n}")
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
        self.finished = threading.Event()
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            for kill in self.plan:
                while self.events.version < kill.at_version and not self.halt.is_set():
                    time.sleep(0.1)
                if self.halt.wait(kill.delay) or SHUTDOWN.interrupted:  # the run is stopping: no more kills
                    return
                before = self.stack.restarts.get(kill.service, 0)
                version = self.events.version
                hold = self.nats_outage if kill.service == "nats" else 0.0
                self.stack.kill(kill.service, hold=hold)
                self.done.append({"service": kill.service, "wall_second": round(time.time() - self.started, 1),
                                  "policy_version": version, **({"down_seconds": hold} if hold else {})})
                self._settle(kill.service, before)
        finally:
            self.finished.set()

    def _settle(self, service: str, before: int) -> None:
        """Wait until the killed process is back (restarted, and SERVING for a service)."""
        deadline = time.time() + self.settle_timeout
        while time.time() < deadline and not self.halt.is_set():
            if self.stack.restarts.get(service, 0) > before and (
                    service == "nats" or health_check(self.stack.address(service))):
                return
            time.sleep(0.2)


def chaos(config: str = "configs/chaos.yaml", *, seed: int = 0, kills: int | None = None,
          services: tuple[str, ...] = TARGETS, name: str = "", nats_mode: str = "single",
          runs_root: pathlib.Path | None = None, progress: bool = True, nats_outage: float = 0.0,
          model_seed: int = 0) -> dict:
    """`seed` chooses the kills; `model_seed` the run's model and sampling (the built model is reused)."""
    from launcher.stack import load_plan

    plan_cfg = load_plan(config)
    builder = plan_cfg["services"]["builder"]
    total, eta = int(builder.get("total_steps", 0)), int(builder.get("max_staleness", 0))
    if total < 4:
        raise ValueError(f"total_steps: a chaos run needs at least 4, got {total}")
    plan = schedule(seed, total, kills=kills, services=services)
    holder: dict = {}

    def on_healthy(stack: Stack, events) -> None:
        holder["killer"] = Killer(stack, events, plan, time.time(), nats_outage=nats_outage)
        holder["killer"].start()

    def before_stop(stack: Stack, summary: dict) -> None:
        killer: Killer | None = holder.get("killer")
        if killer is not None:
            killer.halt.set()
            killer.join(timeout=30)
        result = asyncio.run(audit_run(stack.nats.url, stack.run_dir, completed=bool(summary.get("completed")),
                                       total_steps=total, eta=eta, nats_options=stack.bus_options))
        holder["audit"] = result
        holder["restarts"] = dict(stack.restarts)

    name = name or f"chaos-seed{seed}"
    started = time.time()
    summary = run(config, name=name, seed=model_seed, runs_root=runs_root, progress=progress, nats_mode=nats_mode,
                  on_healthy=on_healthy, before_stop=before_stop)
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
        "completed": bool(summary.get("completed")),
        "steps": len(audit.batch_indices_trained) if audit else 0,
        **({k: v for k, v in audit.to_dict().items() if k not in ("completed", "total_steps")} if audit else {}),
        "wall_seconds": summary.get("wall_seconds"),            # the stack's run, start to report
        "total_seconds": round(time.time() - started, 1),        # with the model build and the audit
        "eval_accuracy_before": summary.get("eval_accuracy_before"),
        "eval_accuracy_after": summary.get("eval_accuracy_after"),
    }
    report["violations"] = audit.violations() if audit else ["no audit: the stack did not come up"]
    if killer is not None and len(killer.done) < len(plan):
        report["kills_missed"] = len(plan) - len(killer.done)  # the run ended first: nothing was violated
    report["passed"] = not report["violations"]
    run_dir = (runs_root or pathlib.Path(__file__).resolve().parent.parent / "runs") / name
    (run_dir / "chaos.json").write_text(json.dumps(report, indent=2))
    return report
