"""Where a run's time goes: the trainer's phase times per step (from its TRAINED events), the rollout engine's per
weight update (run_dir/rollout_metrics.jsonl, written by the rollout service), the CPU-seconds each process spent in
each step (run_dir/cpu_steps.jsonl, sampled by the launcher), their means, and phases.png."""

from __future__ import annotations

import json
import pathlib

from launcher.cpu import CPU_LOG, per_step, role_of, shares

# TRAINED event metric -> label, in the order of a step
TRAINER_PHASES = {"phase_batch_wait_seconds": "waiting for the batch", "phase_pack_seconds": "packing",
                  "phase_recompute_seconds": "no-grad forward (prox / ref)", "phase_forward_seconds": "forward + loss",
                  "phase_backward_seconds": "backward + clipping", "phase_optimizer_seconds": "optimizer step",
                  "weight_sync_seconds": "weight sync"}
ROLLOUT_PHASES = {"engine_busy_seconds": "generating", "pause_drain_seconds": "finishing its step (pause asked)",
                  "engine_pause_seconds": "paused (weights moving)", "idle_seconds": "idle (no work)"}
LATENCIES = ("phase_generation_latency_seconds", "phase_reward_latency_seconds", "phase_batching_latency_seconds")


def rollout_records(run_dir: pathlib.Path) -> list[dict]:
    """The rollout's lines (one per weight update), each with its idle time added."""
    path = run_dir / "rollout_metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        busy = sum(r.get(k, 0.0) for k in ("engine_busy_seconds", "pause_drain_seconds", "engine_pause_seconds"))
        out.append({**r, "idle_seconds": max(0.0, r.get("interval_seconds", 0.0) - busy)})
    return out


def cpu_steps(run_dir: pathlib.Path) -> list[dict]:
    """CPU-seconds per process for each trained step (from the launcher's samples at each step)."""
    path = run_dir / CPU_LOG
    if not path.exists():
        return []
    samples = []
    for line in path.read_text().splitlines():
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return per_step(samples)


def trainer_steps(trained: list[dict]) -> list[dict]:
    """Each TRAINED record's phases; a step's weight sync is reported by the next step's event."""
    syncs = {r["version"] - 1: r["phase_previous_weight_sync_seconds"] for r in trained
             if "phase_previous_weight_sync_seconds" in r}
    return [{"version": r["version"], **{k: r.get(k, 0.0) for k in TRAINER_PHASES if k != "weight_sync_seconds"},
             "weight_sync_seconds": syncs.get(r["version"], 0.0), **{k: r[k] for k in LATENCIES if k in r}}
            for r in trained if "phase_forward_seconds" in r]


def summarize(steps: list[dict], rollout: list[dict]) -> dict:
    """Mean seconds per step of each phase, trainer and rollout, and which side is busier."""
    def mean(rows: list[dict], key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in rows) / len(rows), 4) if rows else 0.0

    trainer = {k: mean(steps, k) for k in (*TRAINER_PHASES, *LATENCIES)}
    gen = {k: mean(rollout, k) for k in (*ROLLOUT_PHASES, "interval_seconds")}
    train_busy = sum(v for k, v in trainer.items() if k in TRAINER_PHASES and k != "phase_batch_wait_seconds")
    return {"trainer": trainer, "rollout": gen, "trainer_busy_seconds": round(train_busy, 4),
            "rollout_busy_seconds": gen["engine_busy_seconds"],
            "bottleneck": "trainer" if train_busy >= gen["engine_busy_seconds"] else "rollout"}


def _stacked(ax, x: list[int], series: dict[str, list[float]]) -> None:
    base = [0.0] * len(x)
    for label, values in series.items():
        ax.bar(x, values, bottom=base, width=0.9, label=label)
        base = [b + v for b, v in zip(base, values, strict=True)]
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper right")


def plot_phases(steps: list[dict], rollout: list[dict], path: pathlib.Path, *, title: str,
                cpu: list[dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3 if cpu else 2, 1, figsize=(10, 10 if cpu else 7), sharex=True)
    top, bottom = axes[0], axes[1]
    for ax, rows, phases in ((top, steps, TRAINER_PHASES), (bottom, rollout, ROLLOUT_PHASES)):
        _stacked(ax, [r["version"] for r in rows], {label: [r.get(key, 0.0) for r in rows] for key, label in phases.items()})
    if cpu:
        roles = sorted({role_of(n) for step in cpu for n in step["cpu"]})
        _stacked(axes[2], [c["version"] for c in cpu],
                 {role: [sum(v for n, v in c["cpu"].items() if role_of(n) == role) for c in cpu] for role in roles})
        split = shares(cpu)["cpu_share"]
        axes[2].set_ylabel("CPU-seconds / step")
        axes[2].set_title("where the CPU goes: " + ", ".join(f"{r} {v:.0%}" for r, v in split.items()), fontsize=9)
    s = summarize(steps, rollout)
    top.set_ylabel("trainer s / step")
    top.set_title(f"{title}\ntrainer busy {s['trainer_busy_seconds']:.3f} s/step, rollout generating "
                  f"{s['rollout_busy_seconds']:.3f} s/update: the {s['bottleneck']} is the bottleneck", fontsize=9)
    bottom.set_ylabel("rollout s / weight update")
    axes[-1].set_xlabel("policy version (the rollout's bar: the update that deployed it)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def phase_report(events, run_dir: pathlib.Path, *, title: str) -> dict:
    """At the run's end: the rollout's lines join metrics.jsonl (kind "rollout"), phases.png is drawn, and the
    means come back for summary.json."""
    steps, rollout = trainer_steps(events.of("trained")), rollout_records(run_dir)
    if rollout:
        with open(events.path, "a") as f:
            for r in rollout:
                record = {"kind": "rollout", **r}
                events.records.append(record)
                f.write(json.dumps(record) + "\n")
    cpu = cpu_steps(run_dir)
    if steps or rollout:
        plot_phases(steps, rollout, run_dir / "phases.png", title=title, cpu=cpu)
    return {**summarize(steps, rollout), **(shares(cpu) if cpu else {})}
