"""`make bench-reward` at toy size: real nats-server, real reward replicas (1, then 2) on one queue group; every
trajectory of both backlogs is scored, with the rewards the tasks call for, and the JSON lines are well-formed."""

from __future__ import annotations

import json

from bench import reward_scaling

CASE_FIELDS = {"bench", "case", "verifier", "replicas", "trajectories", "seconds", "trajectories_per_second",
               "speedup_vs_1", "per_replica", "mean_reward", "expected_mean_reward", "scored_per_replica",
               "cpu_ms_per_trajectory", "machine_busy_cores"}


def test_backlogs_decode_to_their_tasks_and_mix_passing_and_failing():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(reward_scaling.model_path()))
    for verifier in reward_scaling.VERIFIERS:
        trajectories, expected = reward_scaling.backlog(verifier, 8, "t", tokenizer)
        assert len({t.trajectory_id for t in trajectories}) == 8
        assert expected == 0.75   # 1 in 4 wrong
        assert all(len(t.completion_ids) == len(t.behavior_logprobs) == len(t.loss_mask) for t in trajectories)


def test_tiny_run_scores_every_trajectory_with_1_and_2_replicas(capsys):
    reward_scaling.main(["--n", "8", "--n-math", "16", "--replicas", "1,2", "--timeout", "120"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    cases = [r for r in lines if r["case"] == "replicas"]
    assert [(r["verifier"], r["replicas"]) for r in cases] == [
        ("math", 1), ("code_tests", 1), ("math", 2), ("code_tests", 2)]
    for r in cases:
        assert set(r) >= CASE_FIELDS, r
        assert r["bench"] == "reward_scaling"
        assert r["trajectories"] == (16 if r["verifier"] == "math" else 8)
        assert sum(r["scored_per_replica"]) == r["trajectories"] and len(r["scored_per_replica"]) == r["replicas"]
        assert r["mean_reward"] == r["expected_mean_reward"] == 0.75, r   # scored right, not only scored
        assert r["seconds"] > 0 and r["trajectories_per_second"] > 0 and r["speedup_vs_1"] > 0
        assert r["per_replica"] == {"concurrency": 1, "verifier_pool_workers": 1, "sandbox_concurrency": 1}
    assert {r["speedup_vs_1"] for r in cases if r["replicas"] == 1} == {1.0}
    scaling = {r["verifier"]: r for r in lines if r["case"] == "scaling"}
    assert set(scaling) == {"math", "code_tests"}
    for r in scaling.values():
        assert r["speedup_2_vs_1"] > 0 and isinstance(r["target_met"], bool)
