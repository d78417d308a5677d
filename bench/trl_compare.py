"""meshrl vs TRL's GRPOTrainer on the same job, in alternating pairs (meshrl, TRL, meshrl, TRL, ...):

    python -m bench.trl_compare --job tiny|smollm2|smollm2-long [--steps N] [--pairs 3] [--cores 1,2]
                                [--trl-grad-ckpt off] [--extras trl-grad-ckpt-on,meshrl-no-dynamic-sampling]

Both get the same model, prompts (the builder's train split in the order the builder issues it, exported to
JSONL with the ids meshrl's encoder gives), reward (the last number equals the answer), group size, prompts x
completions per step, optimizer updates per step, max new tokens, sampling, learning rate and schedule, clip,
token-mean loss, steps, dtype and cores. TRL runs in .venv-trl (scripts/trl_venv.sh) as bench/trl_job.py with as
many torch threads as cores; meshrl runs its stack (launcher.stack.run) with the job's config shortened to the
same steps. Each run is confined to the first `cores` CPUs of this process (children included).

The main figure is time to a held-out accuracy: the target is TRL's final accuracy (the median over the pairs), and
each run's curve comes from the checkpoints both systems write along the way, evaluated afterwards, outside the
timing, by scripts/eval_checkpoint.py's evaluator (greedy, the builder's eval split). The timed window is the same
for both: from the first generation to the last optimizer step (TRL's checkpoint writes left out; meshrl's own
checkpoint writes count against it). Beside it: seconds and CPU-seconds (the process tree's, inside the window)
per trained sample.

What does not match: the tiny job's GRPO uses dynamic sampling (groups of equal rewards are dropped and refilled,
so it generates more samples than it trains; TRL trains on every group) and meshrl's decoupled off-policy
correction; TRL runs synchronously in one process, meshrl asynchronously in five. The headline TRL setting is its
fastest (gradient checkpointing off); `--extras` runs the others once per core count, beside the pairs.

One JSON line per run (`"case": "run"`) and one per job and core count (`"case": "ratio"`: medians of the pairs
and their spread) on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

import yaml

from bench.trl_window import Measured, Window, median_spread, meshrl_window, run_measured, time_to_accuracy, trl_window
from launcher.runconfig import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
# job -> (config, default steps (0: the config's own), the time-to-accuracy ratio the issue asks for at 2 cores)
JOBS = {"tiny": ("configs/run.yaml", 0, 0.6), "smollm2": ("configs/smollm2.yaml", 30, None),
        "smollm2-long": ("configs/smollm2-long.yaml", 20, 0.5)}
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}  # meshrl loss_agg -> TRL loss_type
EXTRAS = ("trl-grad-ckpt-on", "meshrl-no-dynamic-sampling")
RUN_FIELDS = ("case", "job", "system", "setting", "cores", "pair", "steps", "samples", "window_seconds",
              "seconds_per_sample", "cpu_seconds_per_sample", "accuracy_before", "accuracy_final", "curve",
              "time_to_target_seconds", "peak_rss_bytes")
RATIO_FIELDS = ("case", "job", "cores", "pairs", "trl_setting", "target_accuracy", "time_to_accuracy_ratio",
                "seconds_per_sample_ratio", "cpu_seconds_per_sample_ratio", "meshrl_accuracy_final",
                "trl_accuracy_final")
RUN_TIMEOUT_S = 4 * 3600.0  # one system's whole run (the smollm2 jobs on a CPU take well over an hour)


def job_plan(job: str, steps: int, *, points: int = 10) -> RunConfig:
    """The job's run config with `steps` steps (0: the job's default), evaluated by the builder only before and
    after, and a kept checkpoint every steps // `points` steps for the held-out curve."""
    if job not in JOBS:
        raise ValueError(f"--job: unknown {job!r} (known: {', '.join(JOBS)})")
    config, default_steps, _ = JOBS[job]
    plan = RunConfig.load(config, root=ROOT)
    steps = steps or default_steps or plan.derive(seed=0).total_steps
    if steps < 2:
        raise ValueError(f"--steps: at least 2 (the steady state is measured between steps), got {steps}")
    if points < 1:
        raise ValueError(f"--points: at least 1, got {points}")
    every = max(1, steps // points)
    return plan.replace(builder={**plan.services.builder, "total_steps": steps, "eval_every": 0},
                        trainer={**plan.services.trainer, "checkpoint_every": every, "keep_checkpoints": steps})


def checkpoint_every(plan: RunConfig) -> int:
    return plan.derive(seed=0).trainer.checkpoint_every


def export_rows(plan: RunConfig, *, seed: int, model_dir: str) -> list[dict]:
    """The prompts TRL trains on, in the order meshrl's builder issues them (before any refill), and the eval split:
    {split, prompt (the rendered text), prompt_ids (meshrl's encoding), answer}."""
    import itertools

    from transformers import AutoTokenizer

    from scripts.eval_checkpoint import builder_config
    from services.builder.datasets import shuffled_epochs

    config = builder_config(plan, seed)
    data = config.dataset.build(seed=config.seed, train_size=config.train_size, eval_size=config.eval_size)
    encode = config.dataset.encoder(AutoTokenizer.from_pretrained(model_dir))
    data = data.filtered(lambda task: len(encode(task)), config.dataset.max_prompt_tokens)
    train = itertools.islice(shuffled_epochs(data.train, config.seed), config.total_steps * config.batch_size)
    return [{"split": split, "prompt": encode.text(t), "prompt_ids": encode(t), "answer": t.answer}
            for split, tasks in (("train", train), ("eval", data.eval)) for t in tasks]


def trl_settings(plan: RunConfig, *, seed: int, model_dir: str, data: str, out: str, grad_ckpt: bool,
                 threads: int) -> dict:
    """What bench/trl_job.py needs, taken from the service configs meshrl derives from the same run config."""
    derived = plan.derive(seed=seed)
    builder, trainer = derived.builder, derived.trainer
    algo = trainer.algorithm_config()
    if (algo.objective, algo.reward_norm_mean, algo.reward_norm_std) != ("ppo", "group", "group") or \
            algo.kl_loss_coef or algo.kl_ctl or algo.loss_agg not in LOSS_TYPES:
        raise ValueError(f"trainer.algo: only GRPO-like presets map onto TRL's GRPOTrainer, got {trainer.algo!r}")
    optim, sampling = trainer.optim, builder.sampling
    return {"model": model_dir, "data": data, "out": out, "seed": seed, "threads": threads, "grad_ckpt": grad_ckpt,
            "dtype": trainer.dtype, "steps": builder.total_steps, "batch_size": builder.batch_size,
            "group_size": builder.group_size, "minibatches": optim.minibatches,
            "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "lr": optim.lr, "betas": list(optim.betas),
            "weight_decay": optim.weight_decay, "grad_clip": optim.grad_clip,
            "warmup_updates": optim.warmup_updates, "schedule": optim.schedule,
            "min_lr_ratio": optim.min_lr_ratio, "eps_clip": algo.eps_clip,
            "loss_type": LOSS_TYPES[algo.loss_agg], "checkpoint_every": trainer.checkpoint_every}


def evaluate(model_dir: str, plan: RunConfig, seed: int) -> float:
    from scripts.eval_checkpoint import evaluate as eval_checkpoint

    return eval_checkpoint(model_dir, plan, seed=seed)["accuracy"]


def dynamic_sampling(plan: RunConfig) -> bool:
    return plan.derive(seed=0).builder.dynamic_sampling


def without_dynamic_sampling(plan: RunConfig) -> RunConfig:
    trainer = plan.services.trainer
    return plan.replace(trainer={**trainer, "algo_overrides": {**(trainer.get("algo_overrides") or {}),
                                                               "dynamic_sampling": False}})


def run_meshrl(plan: RunConfig, *, name: str, seed: int, cpus: list[int], runs_root: pathlib.Path,
               tmp: pathlib.Path) -> tuple[Window, Measured]:
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump(plan.to_dict()))
    start = ("import pathlib, sys; from launcher.stack import run; "
             "run(sys.argv[1], name=sys.argv[2], seed=int(sys.argv[3]), runs_root=pathlib.Path(sys.argv[4]), "
             "progress=False)")
    measured = run_measured([sys.executable, "-c", start, str(config), name, str(seed), str(runs_root)], cpus=cpus,
                            timeout=RUN_TIMEOUT_S, cwd=ROOT, stdout=sys.stderr)
    run_dir = runs_root / name
    summary = json.loads((run_dir / "summary.json").read_text())
    if not summary.get("completed"):
        raise RuntimeError(f"meshrl run {run_dir} did not complete")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return meshrl_window(records, run_dir), measured


def run_trl(plan: RunConfig, *, name: str, seed: int, model_dir: str, data: pathlib.Path, grad_ckpt: bool,
            cpus: list[int], runs_root: pathlib.Path, tmp: pathlib.Path) -> tuple[Window, Measured]:
    settings = trl_settings(plan, seed=seed, model_dir=model_dir, data=str(data), out=str(runs_root / name),
                            grad_ckpt=grad_ckpt, threads=len(cpus))
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(settings))
    measured = run_measured([str(TRL_PYTHON), str(ROOT / "bench" / "trl_job.py"), "--settings", str(path)],
                            cpus=cpus, timeout=RUN_TIMEOUT_S, cwd=ROOT, stdout=sys.stderr)
    return trl_window(json.loads((runs_root / name / "result.json").read_text())), measured


def run_line(window: Window, measured: Measured, curve: list[tuple[float, float]], **labels) -> dict:
    """A run's JSON line: its window, per-sample time and CPU, and its held-out curve (seconds, accuracy)."""
    samples = max(1, window.samples)
    return {"case": "run", **labels, "samples": window.samples, "window_seconds": round(window.seconds, 2),
            "seconds_per_sample": round(window.seconds / samples, 5),
            "cpu_seconds_per_sample": round(window.cpu_seconds(measured) / samples, 5),
            "cpu_seconds": round(window.cpu_seconds(measured), 1), "accuracy_before": curve[0][1],
            "accuracy_final": curve[-1][1], "curve": [[round(t, 1), a] for t, a in curve],
            "process_seconds": round(measured.seconds, 1), "peak_rss_bytes": measured.peak_rss_bytes}


def ratio_line(job: str, cores: int, pairs: list[tuple[dict, dict]], *, trl_setting: str) -> dict:
    """Medians over the pairs (and their spread) of meshrl / TRL: time to the target accuracy (TRL's median final
    accuracy), seconds and CPU-seconds per trained sample. A meshrl run that never reached the target counts as
    infinitely slow."""
    target = median_spread([trl["accuracy_final"] for _, trl in pairs])[0]
    ratios: dict[str, list[float | None]] = {"time_to_accuracy": [], "seconds_per_sample": [],
                                             "cpu_seconds_per_sample": []}
    for meshrl, trl in pairs:
        mine, theirs = time_to_accuracy(meshrl["curve"], target), time_to_accuracy(trl["curve"], target)
        meshrl["time_to_target_seconds"], trl["time_to_target_seconds"] = mine, theirs
        ratios["time_to_accuracy"].append(mine / theirs if mine is not None and theirs else None)
        for key in ("seconds_per_sample", "cpu_seconds_per_sample"):
            ratios[key].append(meshrl[key] / trl[key] if trl[key] else None)
    line = {"case": "ratio", "job": job, "cores": cores, "pairs": len(pairs), "trl_setting": trl_setting,
            "target_accuracy": target}
    for key, values in ratios.items():
        line[f"{key}_ratio"], line[f"{key}_ratio_spread"] = median_spread(values)
    line.update(meshrl_accuracy_final=median_spread([m["accuracy_final"] for m, _ in pairs])[0],
                trl_accuracy_final=target, meshrl_reached_target=sum(m["time_to_target_seconds"] is not None
                                                                    for m, _ in pairs))
    goal = JOBS[job][2]
    line["target_ratio"] = goal
    line["target_met"] = None if goal is None or cores != 2 else bool(
        line["time_to_accuracy_ratio"] is not None and line["time_to_accuracy_ratio"] <= goal)
    return line


def held_out_curve(window: Window, plan: RunConfig, seed: int, before: float) -> list[tuple[float, float]]:
    """(seconds into the window, accuracy) from the start (the base model's accuracy) through each checkpoint."""
    return [(0.0, before), *((t, evaluate(path, plan, seed)) for t, path in window.checkpoints)]


def cpu_set(cores: int) -> list[int]:
    mine = sorted(os.sched_getaffinity(0))
    if cores < 1 or cores > len(mine):
        raise ValueError(f"--cores: {cores} is not between 1 and the {len(mine)} CPUs this process may use")
    return mine[:cores]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="tiny")
    parser.add_argument("--steps", type=int, default=0, help="steps of both systems (0: the job's default)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating meshrl / TRL pairs per core count")
    parser.add_argument("--cores", default="2", help="comma-separated core counts, e.g. 1,2")
    parser.add_argument("--points", type=int, default=10, help="checkpoints on each held-out curve")
    parser.add_argument("--trl-grad-ckpt", choices=("on", "off"), default="off",
                        help="TRL's gradient checkpointing in the pairs (off: its faster setting here)")
    parser.add_argument("--extras", default="", help=f"comma-separated, once per core count: {', '.join(EXTRAS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-root", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    if unknown := set(extras) - set(EXTRAS):
        raise ValueError(f"--extras: unknown {sorted(unknown)} (known: {', '.join(EXTRAS)})")
    if args.pairs < 1:
        raise ValueError(f"--pairs: at least 1, got {args.pairs}")
    core_counts = [cpu_set(int(c)) for c in args.cores.split(",")]
    if not TRL_PYTHON.exists():
        raise ValueError(f"{TRL_PYTHON.relative_to(ROOT)} is missing: run scripts/trl_venv.sh first")
    from launcher.stack import resolve_model

    plan = job_plan(args.job, args.steps, points=args.points)
    model_dir = str(resolve_model(plan.model, args.seed))
    runs_root = pathlib.Path(args.runs_root)
    headline = f"grad-ckpt-{args.trl_grad_ckpt}"
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in export_rows(plan, seed=args.seed, model_dir=model_dir)))
        before = evaluate(model_dir, plan, args.seed)

        def meshrl(cpus: list[int], tag: str, variant: RunConfig, setting: str) -> dict:
            name = f"trl-compare-{args.job}-meshrl-{setting}-{len(cpus)}c-{tag}"
            window, measured = run_meshrl(variant, name=name, seed=args.seed, cpus=cpus, runs_root=runs_root,
                                          tmp=tmp)
            return run_line(window, measured, held_out_curve(window, plan, args.seed, before), job=args.job,
                            system="meshrl", setting=setting, cores=len(cpus), pair=tag, steps=total_steps(plan))

        def trl(cpus: list[int], tag: str, grad_ckpt: bool) -> dict:
            setting = f"grad-ckpt-{'on' if grad_ckpt else 'off'}"
            name = f"trl-compare-{args.job}-trl-{setting}-{len(cpus)}c-{tag}"
            window, measured = run_trl(plan, name=name, seed=args.seed, model_dir=model_dir, data=data,
                                       grad_ckpt=grad_ckpt, cpus=cpus, runs_root=runs_root, tmp=tmp)
            return run_line(window, measured, held_out_curve(window, plan, args.seed, before), job=args.job,
                            system="trl", setting=setting, cores=len(cpus), pair=tag, steps=total_steps(plan))

        job_setting = "dynamic-sampling" if dynamic_sampling(plan) else "job"
        for cpus in core_counts:
            pairs = [(meshrl(cpus, str(i), plan, job_setting), trl(cpus, str(i), args.trl_grad_ckpt == "on"))
                     for i in range(args.pairs)]
            ratio = ratio_line(args.job, len(cpus), pairs, trl_setting=headline)
            for pair in pairs:
                for line in pair:
                    print(json.dumps(line), flush=True)
            for extra in extras:
                line = trl(cpus, "extra", args.trl_grad_ckpt != "on") if extra == "trl-grad-ckpt-on" else \
                    meshrl(cpus, "extra", without_dynamic_sampling(plan), "no-dynamic-sampling")
                line["time_to_target_seconds"] = time_to_accuracy(line["curve"], ratio["target_accuracy"])
                print(json.dumps(line), flush=True)
            print(json.dumps(ratio), flush=True)


def total_steps(plan: RunConfig) -> int:
    return plan.derive(seed=0).builder.total_steps


if __name__ == "__main__":
    main()
