"""The README's minimal config (a model directory, two JSONL files a user wrote, the fields, a verifier) runs
through the five processes to trained batches and a final checkpoint; the verifier is `regex`."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from launcher.stack import ROOT, ensure_model, random_ports, run

pytestmark = [pytest.mark.e2e]


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_dataset_with_a_regex_verifier_trains_batches(tmp_path):
    model = ensure_model("tiny-qwen3", 0)   # any Hugging Face model directory
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b), "source": "user"} for a in range(10, 40) for b in (3, 7)]
    minimal = {
        "model": str(model),
        "dataset": {"train": write_jsonl(tmp_path / "train.jsonl", rows[:50]),
                    "eval": write_jsonl(tmp_path / "eval.jsonl", rows[50:]),
                    "prompt_field": "question", "answer_field": "answer",
                    "verifier": "regex", "verifier_options": {"pattern": r"(-?\d+)"}},
    }
    settings = yaml.safe_load((ROOT / "configs" / "e2e-jsonl.yaml").read_text())
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**minimal, **settings}))
    summary = run(str(config), name="jsonl", seed=0, ports=random_ports(), runs_root=tmp_path, progress=False)
    run_dir = tmp_path / "jsonl"
    assert summary["completed"], summary
    assert summary["steps"] == 3
    assert summary["trajectories_trained"] == 3 * 4 * 4
    assert summary["eval_accuracy_before"] is not None and summary["eval_accuracy_after"] is not None
    builder = yaml.safe_load((run_dir / "config" / "builder.yaml").read_text())
    assert builder["dataset"]["verifier"] == "regex"
    assert pathlib.Path(builder["model_path"]).resolve() == pathlib.Path(model).resolve()
    for name in ("summary.json", "metrics.jsonl", "final/model.safetensors", "final/config.json"):
        assert (run_dir / name).exists(), name
