"""The async benchmark's arithmetic and the run report's phase times, on made-up event records."""

from __future__ import annotations

import json
import os

import pytest

from bench.async_speedup import OTHERS, ideal_speedups, phase_times, pin, steady_state
from launcher.phases import phase_report


def trained(version: int, at: float, **phases: float) -> dict:
    return {"kind": "trained", "version": version, "at": at, "trajectories_trained": 512.0 * version,
            "phase_batch_wait_seconds": 0.3, "phase_pack_seconds": 0.01, "phase_recompute_seconds": 0.05,
            "phase_forward_seconds": 0.1, "phase_backward_seconds": 0.2, "phase_optimizer_seconds": 0.02, **phases}


def test_steady_state_leaves_out_the_first_step_and_tt_includes_the_weight_sync():
    records = [trained(1, 10.0), trained(2, 11.0, phase_previous_weight_sync_seconds=0.04),
               trained(3, 12.0, phase_previous_weight_sync_seconds=0.04)]
    assert steady_state(records) == (2.0, 1024.0, 2)
    tt, step = phase_times(records)
    assert abs(tt - (0.38 + 0.04)) < 1e-9 and step == 1.0


class Events:  # what phase_report reads of launcher.report.EventLog
    def __init__(self, path, records):
        self.path, self.records = path, records

    def of(self, kind):
        return [r for r in self.records if r["kind"] == kind]


def test_phase_report_joins_the_rollout_lines_draws_the_plot_and_names_the_bottleneck(tmp_path):
    (tmp_path / "rollout_metrics.jsonl").write_text(
        json.dumps({"version": 1, "engine_pause_seconds": 0.01, "pause_drain_seconds": 0.02, "interval_seconds": 1.0,
                    "engine_busy_seconds": 0.6, "tokens": 3000, "engine_steps": 20}) + "\n" + '{"cut')
    events = Events(tmp_path / "metrics.jsonl", [trained(1, 10.0), trained(2, 11.0, phase_previous_weight_sync_seconds=0.05)])
    summary = phase_report(events, tmp_path, title="test")
    assert (tmp_path / "phases.png").stat().st_size > 0
    assert [r["kind"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == ["rollout"]
    assert abs(summary["rollout"]["idle_seconds"] - 0.37) < 1e-9
    assert summary["trainer"]["weight_sync_seconds"] == 0.025, "step 1's sync, reported by step 2, belongs to step 1"
    assert summary["bottleneck"] == "rollout"


def test_the_report_splits_each_steps_cpu_by_process_and_role(tmp_path):
    """The launcher's cumulative samples at each trained step become CPU-seconds per step per process (a restarted
    process counts from zero), their roles' means and shares in the summary, and a third panel of phases.png."""
    samples = [{"version": 1, "cpu": {"trainer": 10.0, "rollout": 8.0, "reward": 2.0, "nats": 1.0}},
               {"version": 2, "cpu": {"trainer": 11.0, "rollout": 8.5, "reward": 2.25, "nats": 1.25}},
               {"version": 3, "cpu": {"trainer": 12.0, "rollout": 9.0, "reward": 0.5, "nats": 1.5,
                                      "trainer-rank1": 1.0}}]   # the reward service restarted; a rank appeared
    (tmp_path / "cpu_steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples) + '{"cut')
    events = Events(tmp_path / "metrics.jsonl", [trained(1, 10.0), trained(2, 11.0), trained(3, 12.0)])
    without = (tmp_path / "without")
    without.mkdir()
    plain = phase_report(Events(without / "metrics.jsonl", events.records), without, title="test")
    summary = phase_report(events, tmp_path, title="test")
    # message plane: 0.25 + 0.25, then 0.5 (restarted: all of its new total) + 0.25; trainer: 1, then 1 + 1
    assert summary["cpu_seconds_per_step"] == {"message plane": 0.625, "rollout": 0.5, "trainer": 1.5}
    assert summary["cpu_share"] == {"message plane": 0.238, "rollout": 0.19, "trainer": 0.571}
    assert "cpu_share" not in plain, "no samples (a remote stack): no CPU split"
    assert (tmp_path / "phases.png").stat().st_size > (without / "phases.png").stat().st_size


def test_pin_puts_rollout_and_trainer_on_a_cpu_each_and_the_others_where_asked(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setenv("MESHRL_CPUS_REWARD", "7")  # left over from an earlier case: cleared
    assert pin(True, "float") == f"rollout:{cpus[0]},trainer:{cpus[1]}"
    assert (os.environ["MESHRL_CPUS_ROLLOUT"], os.environ["MESHRL_CPUS_TRAINER"]) == (str(cpus[0]), str(cpus[1]))
    assert not any(f"MESHRL_CPUS_{s.upper()}" in os.environ for s in OTHERS)
    assert pin(True, "trainer").startswith(f"rollout:{cpus[0]},trainer:{cpus[1]},")
    assert all(os.environ[f"MESHRL_CPUS_{s.upper()}"] == str(cpus[1]) for s in OTHERS)
    assert pin(False, "trainer") == "" and "MESHRL_CPUS_TRAINER" not in os.environ


def test_the_cpu_aware_ideal_bounds_the_overlapped_step_by_the_cpu_it_needs():
    # a 1.0 s synchronous step: 0.6 s generating, 0.4 s training
    phase, cpu = ideal_speedups(1.0, 0.4, cpu_per_step=1.6, cores=2)
    assert abs(phase - 1 / 0.6) < 1e-9            # the phases alone: the step shrinks to the longer one
    assert abs(cpu - 1 / 0.8) < 1e-9              # 1.6 CPU-s a step on 2 cores cannot take under 0.8 s
    assert ideal_speedups(1.0, 0.4, cpu_per_step=1.0, cores=2)[1] == phase  # CPU to spare: the same ideal
    assert ideal_speedups(1.0, 0.4, cpu_per_step=None, cores=2) == (phase, None)
    assert ideal_speedups(0.0, 0.0, cpu_per_step=1.0, cores=2) == (0.0, None)
