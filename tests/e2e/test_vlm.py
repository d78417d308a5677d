"""Vision-language RL through the five processes, with the launcher's per-identity permissions: the builder stores
the pictures and names them in the work, the rollout fetches their pixels for the engine, the trajectories carry the
names through the reward service and the builder's batches, and the trainer fetches the pixels for every step."""

from __future__ import annotations

import json

import pytest

from launcher.stack import SERVICES, random_ports, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_pictures_reach_the_engine_and_every_training_step(tmp_path):
    summary = run("configs/e2e-vlm.yaml", name="vlm", seed=0, ports=random_ports(), runs_root=tmp_path, progress=False)
    assert summary["completed"], summary
    assert summary["exit_codes"] == {s: 0 for s in SERVICES}
    assert summary["steps"] == 10
    assert summary["status"]["reward"]["dead_lettered"] in (0, "0"), summary["status"]["reward"]
    events = [json.loads(line) for line in (tmp_path / "vlm" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("kind") == "trained"]
    assert len(steps) == 10 and all(e["samples_kept"] > 0 for e in steps)
    # the first step trains on version-0 samples with the version-0 policy: the trainer's recomputed log-probs are
    # the engine's only if it saw the same pictures in the same places
    assert steps[0]["staleness_max_batch"] == 0 and abs(steps[0]["behav_imp_weight_max"] - 1.0) < 0.01, steps[0]
    evals = [e for e in events if e.get("kind") == "eval"]
    assert evals and all(e["n"] == 100 for e in evals)
    logs = (tmp_path / "vlm" / "logs")
    assert "Traceback" not in (logs / "trainer.log").read_text() + (logs / "rollout.log").read_text()
