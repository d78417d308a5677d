"""Run configs the services would refuse stop the launcher before anything starts, with one line naming the
setting: unknown keys, bad values, unreadable dataset rows, verifiers the reward service does not know."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import uuid

import pytest
import yaml

from launcher import preflight
from launcher.stack import ROOT


def write(tmp_path: pathlib.Path, service: str, cfg: dict) -> pathlib.Path:
    path = tmp_path / f"{service}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rows(tmp_path: pathlib.Path, *lines: str) -> str:
    path = tmp_path / f"rows-{uuid.uuid4().hex[:6]}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def builder_with(tmp_path, **dataset) -> pathlib.Path:
    return write(tmp_path, "builder", {"dataset": dataset})


@pytest.mark.parametrize("service,cfg,named", [
    ("builder", {"dataset": {"promt_field": "q"}}, "services.builder.dataset.promt_field: unknown key"),
    ("trainer", {"lr": 3}, "services.trainer.lr: unknown key"),
    ("trainer", {"algo": "nope"}, "services.trainer.algo: unknown preset 'nope'"),
    ("trainer", {"backend": "megatron", "megatron": {"num_layers_in_first_pipeline_stage": 1}},
     "services.trainer.megatron.num_layers_in_first_pipeline_stage: needs pp > 1"),
    ("rollout", {"engine": {"max_batch": "many"}}, "services.rollout.engine.max_batch"),
    ("reward", {"concurrency": "lots"}, "services.reward.concurrency: expected an integer"),
])
def test_a_bad_service_setting_names_its_path(tmp_path, service, cfg, named):
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check_all({service: write(tmp_path, service, cfg)})
    assert named in str(err.value) and "\n" not in str(err.value)


def test_environment_overrides_are_checked_as_the_service_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRL_TRAINER__TEMPERATURE", "0")
    with pytest.raises(preflight.PreflightError, match="temperature: must be > 0"):
        preflight.check_all({"trainer": write(tmp_path, "trainer", {})})


def test_a_preference_dataset_is_checked_without_grading_its_pairs(tmp_path):
    train = rows(tmp_path, '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}')
    evals = rows(tmp_path, '{"prompt": "2+2=", "answer": "4"}')
    configs = preflight.check_all({"builder": builder_with(tmp_path, train=train, eval=evals, preference=True)})
    assert preflight.check_dataset(configs["builder"]) == {"train": 1, "eval": 1}
    bad_eval = rows(tmp_path, '{"prompt": "2+2="}')
    with pytest.raises(preflight.PreflightError, match="missing field 'answer'"):   # eval rows are graded
        preflight.check_dataset(preflight.check_all({"builder": builder_with(tmp_path, train=train, eval=bad_eval,
                                                                             preference=True)})["builder"])


def test_a_good_file_dataset_passes_and_its_rows_are_counted(tmp_path):
    train = rows(tmp_path, '{"prompt": "1+1", "answer": "2"}', '{"prompt": "2+2", "answer": "4", "verifier": "exact"}')
    path = builder_with(tmp_path, train=train, eval_fraction=0.5, verifier="math")
    configs = preflight.check_all({"builder": path})
    assert preflight.check_dataset(configs["builder"]) == {"train": 1, "eval": 1}


@pytest.mark.parametrize("lines,dataset,named", [
    (['{"prompt": "1+1", "answer": "2"}', '{"prompt": "2+2"}'], {}, ":2: missing field 'answer'"),
    (['{"prompt": "1+1", "answer": "2"}', '{"prompt": '], {}, ":2:"),
    (['{"prompt": "1+1", "answer": "2"}'], {"verifier": "exakt"}, "unknown 'exakt'"),
    (['{"prompt": "1+1", "answer": "2", "verifier": "nope"}'], {}, "unknown 'nope'"),
    (['{"prompt": "1+1", "answer": "2"}'], {"verifier": "exact", "verifier_options": {"nmbers": True}},
     "verifier_options.nmbers: unknown option"),
])
def test_a_bad_dataset_row_or_verifier_stops_start_up(tmp_path, lines, dataset, named):
    train = rows(tmp_path, *lines)
    path = builder_with(tmp_path, train=train, eval=train, **dataset)
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check_all({"builder": path})
    assert str(err.value).startswith("dataset: ") and named in str(err.value), err.value


def test_a_missing_dataset_file_is_named(tmp_path):
    missing = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(preflight.PreflightError, match="nowhere.jsonl"):
        preflight.check_all({"builder": builder_with(tmp_path, train=missing, eval=missing)})


def test_an_unknown_reasoning_gym_family_is_refused_before_generation(tmp_path):
    with pytest.raises(preflight.PreflightError, match="unknown reasoning-gym family 'no_such_family'"):
        preflight.check_all({"builder": builder_with(tmp_path, family="no_such_family")})


def test_meshrl_run_prints_one_line_and_starts_nothing(tmp_path):
    """The whole command: exit code 2, one line on stderr naming the key, no service log written."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("{}")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "dataset": {"train": "x.jsonl", "promt_field": "q"}}))
    name = f"pytest-preflight-{uuid.uuid4().hex[:8]}"
    try:
        out = subprocess.run([sys.executable, "-m", "launcher", "run", "--config", str(config), "--name", name],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().count("\n") == 0, out.stderr
        assert "dataset.promt_field: unknown key" in out.stderr
        assert not list((ROOT / "runs" / name).glob("logs/*.log")), "a process started"
    finally:
        shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)


@pytest.fixture
def judge_reset():
    from services.reward.verifiers import judge

    yield
    judge.configure(judge.JudgeConfig())


def test_a_judged_dataset_needs_the_reward_services_judge(tmp_path, judge_reset):
    train = rows(tmp_path, '{"prompt": "Name a prime.", "answer": "7", "verifier": "llm_judge"}')
    builder = builder_with(tmp_path, train=train, eval=train)
    with pytest.raises(preflight.PreflightError, match="judge.base_url"):
        preflight.check_all({"builder": builder, "reward": write(tmp_path, "reward", {})})
    reward = write(tmp_path, "reward", {"judge": {"base_url": "http://127.0.0.1:9/v1", "model": "judge"}})
    assert preflight.check_dataset(preflight.check_all({"builder": builder, "reward": reward})["builder"])
    missing_key = write(tmp_path, "reward", {"judge": {"base_url": "http://127.0.0.1:9/v1", "model": "judge",
                                                       "api_key_file": str(tmp_path / "no-key")}})
    with pytest.raises(preflight.PreflightError, match="services.reward.judge.api_key_file"):
        preflight.check_all({"builder": builder, "reward": missing_key})
