"""MoE routing replay through the five processes: the embedded engine records each token's experts, the routes
travel in the trajectories over the bus (reward service, builder, batches), and every training step routes the
recorded tokens to them."""

from __future__ import annotations

import json

import pytest

from launcher.stack import SERVICES, random_ports, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_routes_recorded_by_the_engine_reach_every_training_step(tmp_path):
    summary = run("configs/e2e-moe-replay.yaml", name="replay", seed=0, ports=random_ports(), runs_root=tmp_path,
                  progress=False)
    assert summary["completed"], summary
    assert summary["exit_codes"] == {s: 0 for s in SERVICES}
    assert summary["steps"] == 8
    events = [json.loads(line) for line in (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if "routing_replayed" in e]
    assert len(steps) == 8, "every step reports its replay"
    # every fed token is recorded (all but a row's last), 2 layers each, replayed in the proximal forward and in
    # the minibatch forwards: at least 2 x 2 x (completion tokens - 1) per row (a group's prompt counts once packed)
    assert all(e["routing_replayed"] >= 2 * 2 * (e["completion_tokens_mean"] - 1) * e["samples_kept"] > 0
               for e in steps), steps[0]
    assert 0.0 <= min(e["routing_differed"] for e in steps) <= max(e["routing_differed"] for e in steps) < 0.5
    reward = summary["status"]["reward"]
    assert int(reward["dead_lettered"]) == 0, reward
