"""The parts of `make bench-trl` that keep the comparison honest, without TRL or .venv-trl: the exported data is the
builder's, TRL's reward is meshrl's verifier, the settings are the run config's, and the JSON lines' schema."""

from __future__ import annotations

import itertools
import os
import sys

import pytest

from bench import trl_job
from bench.trl_compare import (
    RATIO_FIELDS,
    RUN_FIELDS,
    checkpoint_every,
    dynamic_sampling,
    export_rows,
    job_plan,
    ratio_line,
    run_line,
    trl_settings,
    without_dynamic_sampling,
)
from bench.trl_window import Measured, median_spread, meshrl_window, run_measured, time_to_accuracy, trl_window
from services.builder.datasets import arithmetic, shuffled_epochs
from services.reward.verifiers import build_verifier
from services.trainer.models.tiny_qwen3 import build_tokenizer
from services.trainer.optim import OptimConfig


@pytest.fixture
def tiny_tokenizer_dir(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path), tokenizer


def test_export_is_the_builders_train_order_and_eval_split(tiny_tokenizer_dir):
    model_dir, tokenizer = tiny_tokenizer_dir
    plan = job_plan("tiny", 3)
    builder = plan.services.builder
    rows = export_rows(plan, seed=0, model_dir=model_dir)
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    issued = itertools.islice(shuffled_epochs(arithmetic.generate_split("train", builder["train_size"], 0), 0), 3 * 64)
    assert [(r["prompt"], r["answer"]) for r in train] == [(t.prompt, t.answer) for t in issued]
    held_out = arithmetic.generate_split("eval", builder["eval_size"], 0)
    assert [(r["prompt"], r["answer"]) for r in evals] == [(t.prompt, t.answer) for t in held_out]
    assert all(r["prompt_ids"] == tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}


REPLIES = ["47", " 47\n", "the answer is 47", "46 47", "47 46", "", "no idea", "-3", "3", "4.0", "4", "047",
           "12+35=47", "1,047", "47.", "4 7", "-0", "0", "5 - 1 - 6 = -2", "= - 2", "-2", "2", "10", "100", "1e2"]
ANSWERS = ["47", "-3", "4", "0", "-2", "100"]


@pytest.mark.parametrize("grading", [
    {"verifier": "math", "extract": "last_number"},                                        # the tiny job (arithmetic)
    {"verifier": "exact", "extract": "last_number", "verifier_options": {"numbers": True}},  # configs/smollm2.yaml
])
def test_trl_reward_is_meshrls_verifier(grading):
    verifier = build_verifier(grading["verifier"])
    for reply, answer in itertools.product(REPLIES, ANSWERS):
        expected = verifier.score(reply, {**grading, "answer": answer}).reward
        assert trl_job.final_number_reward(reply, answer) == expected, (reply, answer)
    assert trl_job.reward_func(["p", "p"], ["7", "8"], answer=["7", "7"]) == [1.0, 0.0]


def test_trl_schedule_is_meshrls():
    for schedule, warmup in (("linear", 10), ("constant", 1), ("constant", 0)):
        optim = OptimConfig(lr=1.0, warmup_updates=warmup, schedule=schedule)
        for update in range(40):
            ours = optim.lr_factor(update, 40)
            assert trl_job.lr_factor(update, 40, warmup=warmup, schedule=schedule, min_lr_ratio=0.1) == \
                pytest.approx(ours)


def test_trl_settings_are_the_run_configs():
    s = trl_settings(job_plan("tiny", 30), seed=0, model_dir="m", data="d", out="o", grad_ckpt=True, threads=0)
    assert (s["steps"], s["batch_size"], s["group_size"], s["minibatches"]) == (30, 64, 8, 4)
    assert (s["max_new_tokens"], s["lr"], s["betas"], s["schedule"], s["warmup_updates"]) == \
        (8, 0.0005, [0.9, 0.99], "linear", 10)
    assert (s["eps_clip"], s["loss_type"], s["dtype"], s["temperature"]) == (0.2, "dapo", "float32", 1.0)
    assert s["checkpoint_every"] == 3 == checkpoint_every(job_plan("tiny", 30))  # 30 steps // 10 points
    s = trl_settings(job_plan("smollm2", 4), seed=0, model_dir="m", data="d", out="o", grad_ckpt=False, threads=0)
    builder = job_plan("smollm2", 0).services.builder  # the config's own batch, not a copy of it here
    assert (s["steps"], s["batch_size"], s["group_size"], s["minibatches"], s["max_new_tokens"]) == \
        (4, builder["batch_size"], builder["group_size"], 1, builder["sampling"]["max_new_tokens"])
    assert (s["batch_size"], s["group_size"]) == (6, 8)


def test_settings_refuse_what_trl_cannot_match():
    plan = job_plan("tiny", 3)
    plan = plan.replace(trainer={"algo": "rloo"})
    with pytest.raises(ValueError, match="GRPO-like"):
        trl_settings(plan, seed=0, model_dir="m", data="d", out="o", grad_ckpt=True, threads=0)
    with pytest.raises(ValueError, match="--job"):
        job_plan("nope", 3)
    with pytest.raises(ValueError, match="--steps"):
        job_plan("tiny", 1)


def test_the_meshrl_variant_without_dynamic_sampling_turns_it_off_in_builder_and_trainer():
    plan = job_plan("tiny", 3)
    assert dynamic_sampling(plan)  # the tiny job's GRPO refills filtered groups
    off = without_dynamic_sampling(plan)
    assert not dynamic_sampling(off) and dynamic_sampling(plan), "the job's own plan is left as it was"
    derived = off.derive(seed=0)
    assert derived.trainer.algorithm_config().dynamic_sampling is False and derived.builder.dynamic_sampling is False




def test_trl_window_opens_at_the_first_generation_and_leaves_checkpoint_writes_out():
    result = {"window_start": 100.0, "step_ends": [102.0, 104.0, 107.0, 109.0], "samples": 4 * 512,
              "saves": [{"step": 2, "wall_seconds": 1.0, "cpu_seconds": 0.8}], "model_dir": "/r/trl/model"}
    window = trl_window(result)
    assert window.checkpoints == [(4.0, "/r/trl/checkpoints/step-2"), (8.0, "/r/trl/model")]
    assert (window.seconds, window.samples) == (8.0, 2048)
    measured = Measured(10.0, 1, [(100.0, 5.0), (110.0, 25.0)])  # 2 CPU-seconds per second
    assert window.cpu_seconds(measured) == pytest.approx(18.0 - 0.8)


def test_meshrl_window_opens_when_the_builder_issues_training_work(tmp_path):
    records = [{"kind": "eval", "version": 0, "at": 50.0}]
    records += [{"kind": "trained", "version": v, "at": 50.0 + 10 * v, "trajectories_trained": 48.0 * v}
                for v in (1, 2, 3, 4)]
    records.append({"kind": "eval", "version": 4, "at": 95.0})  # the final evaluation is outside the window
    for v in (2, 4):
        (tmp_path / "checkpoints" / f"v{v}").mkdir(parents=True)
    window = meshrl_window(records, tmp_path)
    assert (window.start, window.end, window.samples, window.seconds) == (50.0, 90.0, 192, 40.0)
    assert window.checkpoints == [(20.0, str(tmp_path / "checkpoints" / "v2")), (40.0, str(tmp_path / "final"))]
    with pytest.raises(ValueError, match="version-0 eval"):
        meshrl_window(records[1:], tmp_path)


def test_cpu_between_interpolates_the_samples():
    measured = Measured(1.0, 1, [(0.0, 0.0), (1.0, 1.0), (2.0, 3.0)])
    assert measured.cpu_between(0.5, 1.5) == pytest.approx(1.5)
    assert measured.cpu_between(-5.0, 9.0) == pytest.approx(3.0)  # clamped to the sampled span
    assert Measured(1.0, 1).cpu_between(0.0, 1.0) == 0.0


def test_time_to_accuracy_and_the_ratio_line_take_medians_over_the_pairs():
    assert time_to_accuracy([(0.0, 0.1), (10.0, 0.5), (20.0, 0.7)], 0.5) == 10.0
    assert time_to_accuracy([(0.0, 0.1), (10.0, 0.4)], 0.5) is None
    assert median_spread([2.0, None, 1.0]) == (2.0, [1.0, None])
    assert median_spread([None, None, 1.0]) == (None, [1.0, None])

    def line(system, curve, seconds, cpu):
        return {"case": "run", "system": system, "curve": curve, "accuracy_final": curve[-1][1],
                "seconds_per_sample": seconds, "cpu_seconds_per_sample": cpu}

    pairs = [(line("meshrl", [(0, 0.1), (5, 0.6), (10, 0.7)], 1.0, 2.0), line("trl", [(0, 0.1), (20, 0.6)], 2.0, 2.0)),
             (line("meshrl", [(0, 0.1), (10, 0.5)], 1.0, 2.0), line("trl", [(0, 0.1), (20, 0.5)], 2.0, 4.0)),
             (line("meshrl", [(0, 0.1), (10, 0.3)], 1.0, 2.0), line("trl", [(0, 0.1), (20, 0.55)], 2.0, 4.0))]
    ratio = ratio_line("tiny", 2, pairs, trl_setting="grad-ckpt-off")
    assert set(RATIO_FIELDS) <= set(ratio)
    assert ratio["target_accuracy"] == 0.55  # TRL's median final accuracy
    # pair 1: 5 s vs 20 s; pair 2: meshrl reached 0.5 < 0.55 never, TRL never either; pair 3: meshrl never
    assert (ratio["time_to_accuracy_ratio"], ratio["time_to_accuracy_ratio_spread"]) == (None, [0.25, None])
    assert [m["time_to_target_seconds"] for m, _ in pairs] == [5, None, None]
    assert (ratio["seconds_per_sample_ratio"], ratio["cpu_seconds_per_sample_ratio"]) == (0.5, 0.5)
    assert ratio["meshrl_reached_target"] == 1 and ratio["target_met"] is False
    assert ratio_line("smollm2", 2, pairs, trl_setting="x")["target_met"] is None  # no target for that job
    pairs = [pairs[0]] * 3
    assert ratio_line("tiny", 2, pairs, trl_setting="x")["time_to_accuracy_ratio"] == 0.25
    assert ratio_line("tiny", 2, pairs, trl_setting="x")["target_met"] is True
    assert ratio_line("tiny", 1, pairs, trl_setting="x")["target_met"] is None  # the target is set at 2 cores


def test_run_line_carries_the_schema():
    window = trl_window({"window_start": 0.0, "step_ends": [1.0, 2.0], "samples": 100, "model_dir": "/m/model"})
    line = run_line(window, Measured(3.0, 7, [(0.0, 0.0), (2.0, 3.0)]), [(0.0, 0.1), (2.0, 0.4)], job="tiny",
                    system="trl", setting="grad-ckpt-off", cores=2, pair="0", steps=2)
    line["time_to_target_seconds"] = None
    assert set(RUN_FIELDS) <= set(line)
    assert (line["seconds_per_sample"], line["cpu_seconds_per_sample"], line["accuracy_final"]) == (0.02, 0.03, 0.4)


def test_run_measured_confines_the_tree_to_the_cpus_and_samples_its_cpu(tmp_path):
    first = sorted(os.sched_getaffinity(0))[0]
    child = ("import os, subprocess, sys, time\n"
             "print(sorted(os.sched_getaffinity(0)), flush=True)\n"
             "spin = 'import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass'\n"
             "subprocess.run([sys.executable, '-c', spin], check=True)\n"  # the CPU is a grandchild's
             "time.sleep(0.6)\n")  # sampled after the grandchild was reaped
    out = tmp_path / "out"
    with open(out, "w") as f:
        measured = run_measured([sys.executable, "-c", child], cpus=[first], timeout=60, stdout=f)
    assert out.read_text().strip() == f"[{first}]"
    assert measured.cpu_samples and measured.peak_rss_bytes > 2**20
    assert measured.cpu_samples[-1][1] >= 0.5  # the exited grandchild is in its waiting parent's counts
    with pytest.raises(RuntimeError, match="exited with 3"):
        run_measured([sys.executable, "-c", "raise SystemExit(3)"], cpus=None, timeout=60)
