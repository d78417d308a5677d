"""On-policy distillation from a served teacher through the launcher: the teacher runs as one of the run's frozen
models (its own process and port), started before the stack; the trainer checks its tokenizer at start and asks it
for every batch's token log-probs. With the student's own start as the teacher, the first step's KL to it is 0."""

from __future__ import annotations

import json

import pytest

from launcher.stack import SERVICES, random_ports, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_trainer_distils_from_a_teacher_served_beside_the_stack(tmp_path):
    summary = run("configs/e2e-distill-served.yaml", name="served", seed=0, ports=random_ports(), runs_root=tmp_path,
                  progress=False)
    assert summary["completed"], summary
    assert summary["exit_codes"] == {s: 0 for s in SERVICES}
    assert summary["steps"] == 4
    assert set(summary["frozen_exit_codes"]) == {"teacher"}
    events = [json.loads(line) for line in (tmp_path / "served" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("kind") == "trained"]
    assert len(steps) == 4
    assert abs(steps[0]["kl_ref_k3"]) < 1e-4, steps[0]["kl_ref_k3"]  # the teacher is the student at version 0
    assert max(e["kl_ref_k3"] for e in steps[1:]) > 1e-5  # ... and the student moves away from it
    teacher_log = (tmp_path / "served" / "logs" / "frozen-teacher.log").read_text()
    assert "frozen_model_serving" in teacher_log
