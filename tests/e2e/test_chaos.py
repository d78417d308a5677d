"""Each service, and nats-server, SIGKILLed mid-run and restarted by the supervisor: the run completes with its
invariant (lineage 0..N-1 once each, no trajectory trained twice, no admitted group lost, staleness <= eta).
Also: nats-server gone for over a minute, and a node of a three-node JetStream cluster lost."""

from __future__ import annotations

import pytest

from launcher.chaos import TARGETS, chaos

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CONFIG = "configs/chaos-test.yaml"


def check(report: dict, service: str) -> None:
    assert report["passed"], report["violations"]
    assert [k["service"] for k in report["kills"]] == [service], report["kills"]
    assert report["restarts"][service] >= 1
    assert report["completed"] and report["steps"] == 16
    assert report["groups_lost"] == 0 and report["duplicate_trajectories_trained"] == 0
    assert report["max_staleness_trained"] <= report["eta"]


@pytest.mark.parametrize("service", TARGETS)
def test_a_killed_service_is_restarted_and_the_run_keeps_its_invariant(tmp_path, service):
    report = chaos(CONFIG, seed=11, kills=1, services=(service,), runs_root=tmp_path, progress=False)
    check(report, service)


def test_the_run_rides_out_nats_server_gone_for_over_a_minute(tmp_path):
    report = chaos(CONFIG, seed=5, kills=1, services=("nats",), runs_root=tmp_path, progress=False, nats_outage=65.0)
    check(report, "nats")
    assert report["kills"][0]["down_seconds"] == 65.0
    assert report["wall_seconds"] > 65


def test_losing_a_node_of_a_three_node_cluster_loses_nothing(tmp_path):
    report = chaos(CONFIG, seed=7, kills=1, services=("nats",), runs_root=tmp_path, progress=False,
                   nats_mode="cluster")
    check(report, "nats")
    assert report["nats_mode"] == "cluster"
