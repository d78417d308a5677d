"""The example agents train the policy through the gateway alone, in the five-process system: the calculator agents
report their own rewards; the code agent's episodes are graded by the reward service (code_tests on its last answer)
and its run_python calls run in that service's sandbox."""

from __future__ import annotations

import json

import pytest

from launcher.stack import SERVICES, random_ports, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_example_agents_drive_training_through_the_gateway(tmp_path):
    summary = run("configs/e2e-agent.yaml", name="agents", seed=0, ports=random_ports(), runs_root=tmp_path,
                  progress=False)
    assert summary["completed"], summary
    assert summary["exit_codes"] == {s: 0 for s in SERVICES}
    assert summary["steps"] == 6 and summary["trajectories_trained"] == 6 * 4 * 4
    assert summary["trajectories_generated"] == 0, "no dataset work: every trajectory came through the gateway"
    assert summary["max_staleness_trained"] <= summary["eta"] == 1
    assert len(summary["agent_reward_curve"]) == 6
    events = [json.loads(line) for line in (tmp_path / "agents" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if "process_rewards" in e]
    assert steps and sum(e["process_rewards"] for e in steps) > 0, "the calculator agents' rewards travel as steps"
    budgets = [e for e in events if e.get("kind") == "budget"]
    assert budgets and max(e["limit_groups"] for e in budgets) >= (5 + 1 + 1) * 4, budgets[-1]  # deployed v5+
    log = (tmp_path / "agents" / "logs" / "agents.log").read_text().splitlines()
    episodes = [json.loads(line) for line in log if line.startswith('{"episode"')]
    assert len(episodes) >= 6 * 4 * 4 and all(e["trajectories"] == 1 for e in episodes)
    graded = [e for e in episodes if e.get("graded_by")]
    assert graded and {e["graded_by"] for e in graded} <= {"code_tests", "exact"}  # the code and search agents
    assert all(e["reward"] in (0.0, 0.1, 1.0) for e in episodes if not e.get("graded_by"))
    # graded episodes go through the reward service (traj.raw), the calculator agents' never do; none was refused
    reward = summary["status"]["reward"]
    assert int(reward["scored"]) > 0 and int(reward["dead_lettered"]) == 0, reward
