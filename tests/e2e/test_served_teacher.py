"""On-policy distillation from a served teacher through the launcher: the teacher runs as one of the run's frozen
models (its own process and port), started before the stack; the trainer checks its tokenizer at start and asks it
for every batch's token log-probs. With the student's own start as the teacher, the first step's KL to it is 0."""

from __future__ import annotations

import json

import pytest
import yaml

from launcher.stack import ROOT, SERVICES, random_ports, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("top", [0, 8], ids=["sampled", "and-top-k"])
def test_the_trainer_distils_from_a_teacher_served_beside_the_stack(tmp_path, top):
    """With ``top``, the teacher's 8 likeliest tokens at every position travel too (distill_topk: the frozen
    server's logprobs 8 keyed by token id), and their KL to the student is 0 at the first step as well."""
    plan = yaml.safe_load((ROOT / "configs" / "e2e-distill-served.yaml").read_text())
    if top:   # one update a step: the step's KL is measured before it moves (a second minibatch's is after)
        plan["services"]["trainer"]["algo_overrides"] = {"distill_topk": top}
        plan["services"]["trainer"]["optim"]["minibatches"] = 1
    config = tmp_path / "e2e-distill-served.yaml"
    config.write_text(yaml.safe_dump(plan))
    summary = run(str(config), name="served", seed=0, ports=random_ports(), runs_root=tmp_path, progress=False)
    assert summary["completed"], summary
    assert summary["exit_codes"] == {s: 0 for s in SERVICES}
    assert summary["steps"] == 4
    assert set(summary["frozen_exit_codes"]) == {"teacher"}
    events = [json.loads(line) for line in (tmp_path / "served" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("kind") == "trained"]
    assert len(steps) == 4
    assert abs(steps[0]["kl_ref_k3"]) < 1e-4, steps[0]["kl_ref_k3"]  # the teacher is the student at version 0
    assert max(e["kl_ref_k3"] for e in steps[1:]) > 1e-5  # ... and the student moves away from it
    if top:
        assert abs(steps[0]["teacher_topk_kl"]) < 1e-4 and max(e["teacher_topk_kl"] for e in steps[1:]) > 1e-5
    else:
        assert "teacher_topk_kl" not in steps[0]
    teacher_log = (tmp_path / "served" / "logs" / "frozen-teacher.log").read_text()
    assert "frozen_model_serving" in teacher_log
