"""Both example agents train the policy through the gateway alone, in the five-process system."""

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
    assert steps and all(e["process_rewards"] >= 4 * 4 for e in steps), "every trained trajectory had its step"
    budgets = [e for e in events if e.get("kind") == "budget"]
    assert budgets and max(e["limit_groups"] for e in budgets) >= (5 + 1 + 1) * 4, budgets[-1]  # deployed v5+
    log = (tmp_path / "agents" / "logs" / "agents.log").read_text().splitlines()
    episodes = [json.loads(line) for line in log if line.startswith('{"episode"')]
    assert len(episodes) >= 6 * 4 * 4 and all(e["trajectories"] == 1 for e in episodes)
