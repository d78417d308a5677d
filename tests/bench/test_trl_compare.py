"""The parts of `make bench-trl` that keep the comparison honest, without TRL or .venv-trl: the exported data is the
builder's, TRL's reward is meshrl's verifier, the settings are the run config's, and the JSON lines' schema."""

from __future__ import annotations

import itertools
import os

import pytest

from bench import trl_job
from bench.trl_compare import (
    RATIO_FIELDS,
    SYSTEM_FIELDS,
    dynamic_sampling,
    export_rows,
    job_plan,
    meshrl_figures,
    ratio_line,
    tree_rss,
    trl_figures,
    trl_settings,
    without_dynamic_sampling,
)
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
    s = trl_settings(job_plan("smollm2", 0), seed=0, model_dir="m", data="d", out="o", grad_ckpt=False, threads=0)
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


def test_json_lines_carry_the_schema_and_the_ratio_is_time_per_sample():
    trl = trl_figures({"steps": 3, "samples": 1536, "train_seconds": 12.0, "step_end_offsets": [4.0, 8.0, 12.0],
                       "generation_seconds_total": 3.0, "reward_first": 0.1, "reward_last": 0.3}, 512)
    assert (trl["seconds_per_step"], trl["samples_per_second"], trl["generation_seconds"], trl["training_seconds"]) \
        == (4.0, 128.0, 1.0, 3.0)
    records = [{"kind": "trained", "version": v, "at": 10.0 + v, "trajectories_trained": 512.0 * v} for v in (1, 2, 3)]
    records.append({"kind": "rollout", "version": 1, "engine_busy_seconds": 0.5})
    meshrl = meshrl_figures(records, {"steps": 3, "trajectories_trained": 1536})
    assert (meshrl["seconds_per_step"], meshrl["samples_per_second"], meshrl["generation_seconds"]) == (1.0, 512.0, 0.5)
    for line, system in ((meshrl, "meshrl"), (trl, "trl")):
        line.update(job="tiny", system=system, eval_accuracy_before=0.1, eval_accuracy_after=0.5,
                    peak_rss_bytes=1, process_seconds=10.0, grad_ckpt=True, dynamic_sampling=False)
        assert set(SYSTEM_FIELDS) <= set(line)
    meshrl["eval_accuracy_after"] = 0.6
    ratio = ratio_line("tiny", meshrl, trl)
    assert set(RATIO_FIELDS) <= set(ratio)
    assert ratio["time_per_sample_ratio"] == 0.25 and ratio["eval_accuracy_difference"] == 0.1
    assert ratio["target_met"] is True


def test_the_meshrl_variant_without_dynamic_sampling_turns_it_off_in_builder_and_trainer():
    plan = job_plan("tiny", 3)
    assert dynamic_sampling(plan)  # the tiny job's GRPO refills filtered groups
    off = without_dynamic_sampling(plan)
    assert not dynamic_sampling(off) and dynamic_sampling(plan), "the job's own plan is left as it was"
    derived = off.derive(seed=0)
    assert derived.trainer.algorithm_config().dynamic_sampling is False and derived.builder.dynamic_sampling is False


def test_tree_rss_counts_this_process():
    assert tree_rss(os.getpid()) > 10 * 2**20
