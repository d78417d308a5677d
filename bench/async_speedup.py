"""Asynchronous vs synchronous training on the same job: the default run config (tiny Qwen3, 64 prompts x 8
samples per step) for a few steps at eta = 0 (synchronous: generation waits for the new weights), then at each
asynchronous eta, with rollout and trainer pinned to separate cores (MESHRL_CPUS_ROLLOUT / MESHRL_CPUS_TRAINER)
and one torch thread each. The other services float over both cores, or with `--others trainer` share the
trainer's (generation, the longer phase of the default job, then has a core to itself).

    python -m bench.async_speedup [--steps 40] [--etas 0,1,2] [--config configs/run.yaml] [--seed 0] [--others float]

One JSON line per case on stdout. Throughput is the steady state: the samples trained after the first step over
the time from the first to the last TRAINED event (start-up, the first batch and the final evaluation are left
out; `run_wall_seconds` is the whole run). From the synchronous run's phase times: Tt = the trainer's busy time
per step (packing, forwards, backward, optimizer, weight sync) and Tg = the rest of its step (generation, reward,
batching, the bus), so Tg + Tt is the synchronous step and the ideal asynchronous speed-up is
(Tg + Tt) / max(Tg, Tt). That ideal assumes each phase keeps its synchronous speed; on a machine whose cores the
overlapped phases fill, they cannot. So a second, CPU-aware ideal also bounds the step by the CPU it needs:
(Tg + Tt) / max(Tg, Tt, C / cores), C = the synchronous run's CPU-seconds per step (every service's process tree
and nats-server, from the stack being healthy to the run's end: its two evaluations included, which slightly
overstates a step's CPU). Both are reported. Runs on a shared machine are noisy: the cases run back to back,
compare them together.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import tempfile

import yaml

from launcher.runconfig import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAINER_BUSY = ("phase_pack_seconds", "phase_recompute_seconds", "phase_forward_seconds", "phase_backward_seconds",
                "phase_optimizer_seconds")


def case_plan(config: str, *, eta: int, steps: int, threads: int) -> RunConfig:
    plan = RunConfig.load(config, root=ROOT)
    sections = plan.services
    return plan.replace(
        builder={**sections.builder, "max_staleness": eta, "total_steps": steps, "eval_every": steps},  # before, after
        rollout={**sections.rollout, "engine": {**(sections.rollout.get("engine") or {}), "torch_threads": threads}},
        trainer={**sections.trainer, "torch_threads": threads})


OTHERS = ("reward", "builder", "weight_exchange")  # the services beside rollout and trainer (nats-server floats)


def pin(enabled: bool, others: str = "float") -> str:
    """Rollout on the first CPU this process may use, trainer on the second; the other services float over both
    (`others` "float") or share the trainer's CPU ("trainer")."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    for service in ("rollout", "trainer", *OTHERS):
        os.environ.pop(f"MESHRL_CPUS_{service.upper()}", None)
    if not enabled or len(cpus) < 2:
        return ""
    os.environ["MESHRL_CPUS_ROLLOUT"], os.environ["MESHRL_CPUS_TRAINER"] = str(cpus[0]), str(cpus[1])
    if others == "trainer":
        for service in OTHERS:
            os.environ[f"MESHRL_CPUS_{service.upper()}"] = str(cpus[1])
        return f"rollout:{cpus[0]},trainer:{cpus[1]},{'+'.join(OTHERS)}:{cpus[1]}"
    return f"rollout:{cpus[0]},trainer:{cpus[1]}"


def steady_state(trained: list[dict]) -> tuple[float, float, int]:
    """(seconds, samples) from the first to the last TRAINED event, and the steps in between."""
    trained = sorted(trained, key=lambda r: r["version"])
    if len(trained) < 2:
        return 0.0, 0.0, 0
    seconds = trained[-1]["at"] - trained[0]["at"]
    samples = trained[-1].get("trajectories_trained", 0.0) - trained[0].get("trajectories_trained", 0.0)
    return seconds, samples, len(trained) - 1


def phase_times(trained: list[dict]) -> tuple[float, float]:
    """(Tt, step): the trainer's mean busy seconds per step incl. weight sync, and the mean step interval."""
    seconds, _, steps = steady_state(trained)
    later = [r for r in trained if r["version"] > min(x["version"] for x in trained)]
    if not steps or not later:
        return 0.0, 0.0
    busy = sum(sum(r.get(k, 0.0) for k in TRAINER_BUSY) + r.get("phase_previous_weight_sync_seconds", 0.0)
               for r in later) / len(later)
    return busy, seconds / steps


def ideal_speedups(step_seconds: float, trainer_busy: float, cpu_per_step: float | None, cores: int
                   ) -> tuple[float, float | None]:
    """(phase ideal, CPU-aware ideal) of overlapping the synchronous step's generation (Tg) and training (Tt)
    phases, Tg + Tt = `step_seconds`; the second also bounds the overlapped step by `cpu_per_step` / `cores`."""
    tt = trainer_busy
    tg = max(0.0, step_seconds - tt)
    bound = max(tg, tt)
    if bound <= 0:
        return 0.0, None
    phase = (tg + tt) / bound
    if not cpu_per_step or cores < 1:
        return phase, None
    return phase, (tg + tt) / max(bound, cpu_per_step / cores)


class CpuWindow:
    """CPU-seconds the stack spends from healthy to its stop (the launcher's on_healthy / before_stop hooks)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.spent: float | None = None

    def healthy(self, stack, events) -> None:
        cpu = stack.cpu_seconds()
        self.start = sum(cpu.values()) if cpu else None

    def stopping(self, stack, summary) -> None:
        cpu = stack.cpu_seconds()
        if cpu and self.start is not None:
            self.spent = sum(cpu.values()) - self.start


def run_case(config: str, *, eta: int, steps: int, seed: int, threads: int, pinned: bool, runs_root: pathlib.Path,
             tmp: pathlib.Path, others: str = "float") -> dict:
    from launcher.stack import run

    plan = case_plan(config, eta=eta, steps=steps, threads=threads)
    path = tmp / f"eta{eta}.yaml"
    path.write_text(yaml.safe_dump(plan.to_dict()))
    placement = pin(pinned, others)
    name = f"async-eta{eta}"
    window = CpuWindow()
    with contextlib.redirect_stdout(sys.stderr):  # the launcher prints its summary: keep stdout for JSON lines
        summary = run(str(path), name=name, seed=seed, runs_root=runs_root, progress=False,
                      on_healthy=window.healthy, before_stop=window.stopping)
    records = [json.loads(line) for line in (runs_root / name / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["kind"] == "trained"]
    rollout = [r for r in records if r["kind"] == "rollout"]
    seconds, samples, _ = steady_state(trained)
    tt, step = phase_times(trained)
    return {"model": plan.model, "eta": eta, "steps": summary.get("steps", 0),
            "samples_trained": summary.get("trajectories_trained", 0), "wall_seconds": round(seconds, 2),
            "samples_per_second": round(samples / seconds, 2) if seconds else 0.0,
            "eval_accuracy_after": summary.get("eval_accuracy_after"),
            "max_staleness_trained": summary.get("max_staleness_trained", 0),
            "dropped_stale": summary.get("trajectories_dropped_stale", 0),
            "completed": summary.get("completed", False), "run_wall_seconds": summary.get("wall_seconds"),
            "step_seconds": round(step, 4), "trainer_busy_seconds": round(tt, 4),
            "rollout_generating_seconds": round(sum(r.get("engine_busy_seconds", 0.0) for r in rollout)
                                                / len(rollout), 4) if rollout else None,
            "extra_prompts_issued": summary.get("extra_prompts_issued", 0), "pinned": placement,
            "cpu_seconds_per_step": round(window.spent / summary["steps"], 4)
            if window.spent is not None and summary.get("steps") else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/run.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--etas", default="0,1,2", help="comma-separated; 0 (synchronous) is the baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of rollout and trainer each")
    parser.add_argument("--no-pin", action="store_true", help="leave rollout and trainer unpinned")
    parser.add_argument("--others", choices=("float", "trainer"), default="float",
                        help="reward, builder and weight exchange: over both CPUs, or on the trainer's")
    parser.add_argument("--runs-root", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args(argv)
    etas = [int(e) for e in args.etas.split(",")]
    if 0 not in etas:
        etas.insert(0, 0)
    etas = sorted(set(etas))
    runs_root = pathlib.Path(args.runs_root)
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for eta in etas:
            cases.append(run_case(args.config, eta=eta, steps=args.steps, seed=args.seed, threads=args.threads,
                                  pinned=not args.no_pin, runs_root=runs_root, tmp=pathlib.Path(tmp),
                                  others=args.others))
    sync = cases[0]
    tt = sync["trainer_busy_seconds"]
    tg = max(0.0, sync["step_seconds"] - tt)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ideal, cpu_ideal = ideal_speedups(sync["step_seconds"], tt, sync["cpu_seconds_per_step"], cores)
    for case in cases:
        speedup = case["samples_per_second"] / sync["samples_per_second"] if sync["samples_per_second"] else 0.0
        case.update(speedup_vs_sync=round(speedup, 3), ideal_speedup=round(ideal, 3),
                    fraction_of_ideal=round(speedup / ideal, 3) if ideal else 0.0,
                    cpu_ideal_speedup=round(cpu_ideal, 3) if cpu_ideal else None,
                    fraction_of_cpu_ideal=round(speedup / cpu_ideal, 3) if cpu_ideal else None, cores=cores,
                    sync_tg_seconds=round(tg, 4), sync_tt_seconds=round(tt, 4))
        print(json.dumps(case), flush=True)


if __name__ == "__main__":
    main()
