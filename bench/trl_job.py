"""TRL's GRPOTrainer on a job exported by bench/trl_compare.py; runs in .venv-trl (scripts/trl_venv.sh), never in
.venv: it imports trl, transformers and datasets only, and nothing of meshrl.

    .venv-trl/bin/python bench/trl_job.py --settings SETTINGS.json

SETTINGS.json (written by trl_compare.trl_settings) names the exported data (JSONL rows: split, prompt, prompt_ids,
answer), the model, the output directory and every matched hyperparameter. Writes `<out>/model` (the trained
model and tokenizer), `<out>/checkpoints/step-N` every `checkpoint_every` steps (for the held-out curve) and
`<out>/result.json` (timings and rewards); prints nothing on stdout.

Times are Unix seconds, so the caller can line them up with the CPU it sampled: the window opens when the first
generation starts and closes at the last optimizer step. Checkpoint writes are timed (wall and this process's CPU)
so the caller can leave them out: TRL would not write them in a real run of this length.
"""

from __future__ import annotations

import argparse
import decimal
import json
import pathlib
import re
import time

# meshrl's "last_number" extraction (services/reward/verifiers/base.py), restated: this venv cannot import meshrl
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def final_number_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's last number equals the answer as a number ("047" and "47.0" read 47), else 0.0."""
    got = final_number(completion)
    if got is None:
        return 0.0
    try:
        return 1.0 if decimal.Decimal(got) == decimal.Decimal(answer.strip()) else 0.0
    except decimal.InvalidOperation:
        return 0.0


def reward_func(prompts, completions, answer, **_) -> list[float]:
    return [final_number_reward(c, a) for c, a in zip(completions, answer, strict=True)]


def lr_factor(update: int, total: int, *, warmup: int, schedule: str, min_lr_ratio: float) -> float:
    """meshrl's learning-rate multiplier (services/trainer/optim.py OptimConfig.lr_factor), restated."""
    warm = min(1.0, (update + 1) / (warmup + 1))
    if schedule == "constant" or update < warmup:
        return warm
    done = min(1.0, (update - warmup) / max(1, total - warmup))
    return 1.0 - (1.0 - min_lr_ratio) * done


def read_rows(path: pathlib.Path, split: str) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == split]


def run_job(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", required=True, type=pathlib.Path)
    s = json.loads(parser.parse_args(argv).settings.read_text())

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if s["threads"]:
        torch.set_num_threads(s["threads"])
    out = pathlib.Path(s["out"])
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    rows = read_rows(pathlib.Path(s["data"]), "train")
    for r in rows:  # TRL tokenizes a plain-text prompt itself: it must give the ids meshrl's builder issues
        if tokenizer(text=r["prompt"])["input_ids"] != r["prompt_ids"]:
            raise ValueError(f"prompt {r['prompt']!r}: TRL's tokenization differs from meshrl's")
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)

    updates_per_step = s["minibatches"]
    samples_per_step = s["batch_size"] * s["group_size"]
    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, seed=s["seed"], report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=updates_per_step, shuffle_dataset=False,  # the exported order is meshrl's
        max_steps=s["steps"] * updates_per_step, num_generations=s["group_size"],
        per_device_train_batch_size=samples_per_step // updates_per_step, gradient_accumulation_steps=1,
        steps_per_generation=updates_per_step, num_iterations=1, max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=s["top_p"], top_k=0, learning_rate=s["lr"],
        adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], weight_decay=s["weight_decay"],
        max_grad_norm=s["grad_clip"], epsilon=s["eps_clip"], beta=0.0, loss_type=s["loss_type"],
        scale_rewards="group", gradient_checkpointing=s["grad_ckpt"], bf16=s["dtype"] == "bfloat16", fp16=False)

    class MeshrlSchedule(GRPOTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer,
                    lambda n: lr_factor(n, num_training_steps, warmup=s["warmup_updates"], schedule=s["schedule"],
                                        min_lr_ratio=s["min_lr_ratio"]))
            return self.lr_scheduler

    step_ends: list[float] = []
    saves: list[dict] = []
    every = s.get("checkpoint_every", 0)

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % updates_per_step:
                return
            step_ends.append(time.time())
            step = len(step_ends)
            if every and step % every == 0 and step < s["steps"]:  # the last step's model is `model`
                wall, cpu = time.time(), time.process_time()
                path = str(out / "checkpoints" / f"step-{step}")
                kwargs["model"].save_pretrained(path)
                tokenizer.save_pretrained(path)  # the evaluator reads it from the model's directory
                saves.append({"step": step, "wall_seconds": time.time() - wall,
                              "cpu_seconds": time.process_time() - cpu})

    trainer = MeshrlSchedule(model=model, reward_funcs=reward_func, args=config, train_dataset=dataset,
                             processing_class=tokenizer, callbacks=[StepClock()])
    generating = [0.0]
    first_generation: list[float] = []
    sample = trainer._generate

    def timed_generate(prompts):
        started = time.perf_counter()
        if not first_generation:
            first_generation.append(time.time())
        try:
            return sample(prompts)
        finally:
            generating[0] += time.perf_counter() - started

    trainer._generate = timed_generate  # sampling only; rewards and the old-logprob forward count as training
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {"steps": len(step_ends), "samples": len(step_ends) * samples_per_step,
              "train_seconds": train_seconds, "window_start": first_generation[0], "step_ends": step_ends,
              "saves": saves, "generation_seconds_total": generating[0],
              "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
              "model_dir": str(out / "model")}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_job()
