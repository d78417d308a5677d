"""meshrl vs TRL's GRPOTrainer on the same job, one after the other in one invocation:

    python -m bench.trl_compare --job tiny|smollm2 [--steps N] [--trl-grad-ckpt on|off|both] [--seed 0]

Both get the same model, prompts (the builder's train split in the order the builder issues it, exported to
JSONL with the ids meshrl's encoder gives), reward (the last number equals the answer), group size, prompts x
completions per step, optimizer updates per step, max new tokens, sampling, learning rate and schedule, clip,
token-mean loss, steps and dtype. TRL runs in .venv-trl (scripts/trl_venv.sh) as bench/trl_job.py; meshrl runs
its stack (launcher.stack.run) with the job's config shortened to the same steps. Held-out accuracy for both:
scripts/eval_checkpoint.py's evaluator (greedy, the builder's eval split) on the start and the trained models.

What does not match: the tiny job's GRPO uses dynamic sampling (groups of equal rewards are dropped and refilled,
so it generates more samples than it trains; TRL trains on every group) and meshrl's decoupled off-policy
correction; TRL runs synchronously in one process on torch's default threads, meshrl asynchronously in five.
`--meshrl-dynamic-sampling both` (the default) runs meshrl with the job's setting and with dynamic sampling off,
the same work per trained sample as TRL: both are recorded, as are TRL with and without gradient checkpointing.

One JSON line per system (TRL once per gradient-checkpointing setting) and one `ratio` line per job on stdout.
`seconds_per_step` is the steady state (from the end of the first step to the end of the last); `process_seconds`
the whole process, start-up and meshrl's own evals included; `peak_rss_bytes` the largest summed RSS of the
process tree, sampled every 0.2 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import yaml

from bench.async_speedup import phase_times, steady_state
from launcher.runconfig import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
JOBS = {"tiny": ("configs/run.yaml", 0), "smollm2": ("configs/smollm2.yaml", 4)}  # config, default steps (0: its own)
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}  # meshrl loss_agg -> TRL loss_type
SYSTEM_FIELDS = ("job", "system", "steps", "samples", "seconds_per_step", "samples_per_second", "generation_seconds",
                 "training_seconds", "eval_accuracy_before", "eval_accuracy_after", "peak_rss_bytes")
RUN_TIMEOUT_S = 4 * 3600.0  # one system's whole run (the smollm2 job on a CPU takes well over an hour)
RATIO_FIELDS = ("job", "system", "time_per_sample_ratio", "eval_accuracy_difference")


def job_plan(job: str, steps: int) -> RunConfig:
    """The job's run config with `steps` steps (0: the config's), evaluated only before and after."""
    if job not in JOBS:
        raise ValueError(f"--job: unknown {job!r} (known: {', '.join(JOBS)})")
    config, default_steps = JOBS[job]
    plan = RunConfig.load(config, root=ROOT)
    steps = steps or default_steps or plan.derive(seed=0).total_steps
    if steps < 2:
        raise ValueError(f"--steps: at least 2 (the steady state is measured between steps), got {steps}")
    return plan.replace(builder={**plan.services.builder, "total_steps": steps, "eval_every": 0})


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
            "loss_type": LOSS_TYPES[algo.loss_agg]}


def tree_rss(root: int) -> int:
    """Summed resident memory of `root` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(pathlib.Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    total, todo, page = 0, [root], os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
    return total


def run_measured(cmd: list[str], timeout: float = RUN_TIMEOUT_S, **kwargs) -> tuple[float, int]:
    """(seconds, peak tree RSS) of a command that must succeed within `timeout` seconds (past it: SIGTERM, so a
    meshrl stack stops its services, then SIGKILL, and a RuntimeError naming the command)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, **kwargs)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        raise RuntimeError(f"{cmd[:3]} did not finish within {timeout:g}s (stopped; peak RSS so far "
                           f"{peak[0]} bytes)") from None
    finally:
        sampler.join(5)  # it ends within one 0.2 s sample once the process is gone
    if code:
        raise RuntimeError(f"{cmd[:3]} exited with {code}")
    return time.perf_counter() - started, peak[0]


def trl_figures(result: dict, samples_per_step: int) -> dict:
    """Per-step figures from bench/trl_job.py's result.json."""
    steps, ends = result["steps"], result["step_end_offsets"]
    per_step = (ends[-1] - ends[0]) / (steps - 1) if steps > 1 else result["train_seconds"]
    generation = result["generation_seconds_total"] / steps
    return {"steps": steps, "samples": result["samples"], "seconds_per_step": round(per_step, 4),
            "samples_per_second": round(samples_per_step / per_step, 2),
            "generation_seconds": round(generation, 4),
            "training_seconds": round(result["train_seconds"] / steps - generation, 4),
            "reward_first": result["reward_first"], "reward_last": result["reward_last"]}


def meshrl_figures(records: list[dict], summary: dict) -> dict:
    """Per-step figures from a run's metrics.jsonl records and summary.json, as bench/async_speedup reads them."""
    trained = [r for r in records if r["kind"] == "trained"]
    rollout = [r for r in records if r["kind"] == "rollout"]
    seconds, samples, steps = steady_state(trained)
    busy, _ = phase_times(trained)
    return {"steps": summary.get("steps", 0), "samples": summary.get("trajectories_trained", 0),
            "seconds_per_step": round(seconds / steps, 4) if steps else 0.0,
            "samples_per_second": round(samples / seconds, 2) if seconds else 0.0,
            "generation_seconds": round(sum(r.get("engine_busy_seconds", 0.0) for r in rollout) / len(rollout), 4)
            if rollout else 0.0, "training_seconds": round(busy, 4),
            "samples_generated": summary.get("trajectories_generated", 0),
            "builder_eval_accuracy_before": summary.get("eval_accuracy_before"),
            "builder_eval_accuracy_after": summary.get("eval_accuracy_after")}


def ratio_line(job: str, meshrl: dict, trl: dict) -> dict:
    """meshrl's time per trained sample over TRL's (steady state), and the held-out accuracy difference."""
    ratio = trl["samples_per_second"] / meshrl["samples_per_second"] if meshrl["samples_per_second"] else None
    diff = meshrl["eval_accuracy_after"] - trl["eval_accuracy_after"]
    return {"job": job, "system": "ratio", "time_per_sample_ratio": round(ratio, 3) if ratio else None,
            "eval_accuracy_difference": round(diff, 4), "trl_grad_ckpt": trl["grad_ckpt"],
            "meshrl_dynamic_sampling": meshrl["dynamic_sampling"],
            "process_seconds_ratio": round(meshrl["process_seconds"] / trl["process_seconds"], 3),
            "target_met": bool(ratio is not None and ratio <= 0.5 and diff >= 0)}


def evaluate(model_dir: str, plan: RunConfig, seed: int) -> float:
    from scripts.eval_checkpoint import evaluate as eval_checkpoint

    return eval_checkpoint(model_dir, plan, seed=seed)["accuracy"]


def dynamic_sampling(plan: RunConfig) -> bool:
    return plan.derive(seed=0).builder.dynamic_sampling


def without_dynamic_sampling(plan: RunConfig) -> RunConfig:
    trainer = plan.services.trainer
    return plan.replace(trainer={**trainer, "algo_overrides": {**(trainer.get("algo_overrides") or {}),
                                                               "dynamic_sampling": False}})


def run_meshrl(job: str, plan: RunConfig, *, seed: int, runs_root: pathlib.Path, tmp: pathlib.Path) -> dict:
    sampling = dynamic_sampling(plan)
    config = tmp / f"meshrl-{sampling}.yaml"
    config.write_text(yaml.safe_dump(plan.to_dict()))
    name = f"trl-compare-{job}-meshrl{'' if sampling else '-no-dynamic-sampling'}"
    start = ("import pathlib, sys; from launcher.stack import run; "
             "run(sys.argv[1], name=sys.argv[2], seed=int(sys.argv[3]), runs_root=pathlib.Path(sys.argv[4]), "
             "progress=False)")
    seconds, peak = run_measured([sys.executable, "-c", start, str(config), name, str(seed), str(runs_root)],
                                 cwd=ROOT, stdout=sys.stderr)
    run_dir = runs_root / name
    summary = json.loads((run_dir / "summary.json").read_text())
    if not summary.get("completed"):
        raise RuntimeError(f"meshrl run {run_dir} did not complete")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {**meshrl_figures(records, summary), "dynamic_sampling": sampling, "model_dir": str(run_dir / "final"),
            "process_seconds": round(seconds, 1), "peak_rss_bytes": peak}


def run_trl(job: str, plan: RunConfig, *, seed: int, model_dir: str, data: pathlib.Path, grad_ckpt: bool, threads: int,
            runs_root: pathlib.Path, tmp: pathlib.Path) -> dict:
    out = runs_root / f"trl-compare-{job}-trl{'' if grad_ckpt else '-no-grad-ckpt'}"
    settings = trl_settings(plan, seed=seed, model_dir=model_dir, data=str(data), out=str(out), grad_ckpt=grad_ckpt,
                            threads=threads)
    path = tmp / f"trl-{grad_ckpt}.json"
    path.write_text(json.dumps(settings))
    seconds, peak = run_measured([str(TRL_PYTHON), str(ROOT / "bench" / "trl_job.py"), "--settings", str(path)],
                                 cwd=ROOT, stdout=sys.stderr)
    result = json.loads((out / "result.json").read_text())
    return {**trl_figures(result, settings["batch_size"] * settings["group_size"]), "grad_ckpt": grad_ckpt,
            "model_dir": result["model_dir"], "process_seconds": round(seconds, 1), "peak_rss_bytes": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=sorted(JOBS), default="tiny")
    parser.add_argument("--steps", type=int, default=0, help="steps of both systems (0: the job's default)")
    parser.add_argument("--trl-grad-ckpt", choices=("on", "off", "both"), default="both",
                        help="TRL's gradient checkpointing (its default is on)")
    parser.add_argument("--meshrl-dynamic-sampling", choices=("job", "off", "both"), default="both",
                        help="meshrl with the job's dynamic sampling setting, with it off, or both")
    parser.add_argument("--trl-threads", type=int, default=0, help="torch threads of the TRL process (0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-root", default=str(ROOT / "runs" / "bench"))
    args = parser.parse_args(argv)
    if not TRL_PYTHON.exists():
        raise ValueError(f"{TRL_PYTHON.relative_to(ROOT)} is missing: run scripts/trl_venv.sh first")
    from launcher.stack import resolve_model

    plan = job_plan(args.job, args.steps)
    model_dir = str(resolve_model(plan.model, args.seed))
    runs_root = pathlib.Path(args.runs_root)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        data = tmp / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in export_rows(plan, seed=args.seed, model_dir=model_dir)))
        before = evaluate(model_dir, plan, args.seed)
        plans = {"job": [plan], "off": [without_dynamic_sampling(plan)],
                 "both": [plan, without_dynamic_sampling(plan)]}[args.meshrl_dynamic_sampling]
        if args.meshrl_dynamic_sampling == "both" and not dynamic_sampling(plan):
            plans = plans[:1]  # the job has it off already: one run
        meshrls = [run_meshrl(args.job, p, seed=args.seed, runs_root=runs_root, tmp=tmp) for p in plans]
        ckpts = {"on": [True], "off": [False], "both": [True, False]}[args.trl_grad_ckpt]
        trls = [run_trl(args.job, plan, seed=args.seed, model_dir=model_dir, data=data, grad_ckpt=c,
                        threads=args.trl_threads, runs_root=runs_root, tmp=tmp) for c in ckpts]
    for system, line in (*(("meshrl", m) for m in meshrls), *(("trl", t) for t in trls)):
        line.update(job=args.job, system=system, eval_accuracy_before=before,
                    eval_accuracy_after=evaluate(line["model_dir"], plan, args.seed))
        print(json.dumps({**{k: line[k] for k in SYSTEM_FIELDS}, **line}), flush=True)
    for meshrl in meshrls:
        for trl in trls:
            print(json.dumps(ratio_line(args.job, meshrl, trl)), flush=True)


if __name__ == "__main__":
    main()
