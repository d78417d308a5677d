"""Each service, and nats-server, SIGKILLed mid-run and restarted by the supervisor: the run completes with its
invariant (lineage 0..N-1 once each, no trajectory trained twice, no admitted group lost, staleness <= eta).
And (`make chaos-extended`): a second builder as a standby taking over, the other services' kills, a node of a
three-node JetStream cluster lost, TRAJ at its byte cap on the least budget, nats-server gone for over a minute and
gone past the dedupe window."""

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


# make test kills the trainer and nats-server (a short outage: every service reconnects); the other services' kills,
# the three-node cluster and TRAJ at its cap run in `make chaos-extended` (~10 min more), as `make chaos` kills all
IN_MAKE_TEST = ("trainer", "nats")


@pytest.mark.parametrize("service", [s if s in IN_MAKE_TEST else pytest.param(s, marks=pytest.mark.extended)
                                     for s in TARGETS])
def test_a_killed_service_is_restarted_and_the_run_keeps_its_invariant(tmp_path, service):
    report = chaos(CONFIG, seed=11, kills=1, services=(service,), runs_root=tmp_path, progress=False)
    check(report, service)


@pytest.mark.extended  # ~2 min; make test's [nats] case covers a short outage, chaos-extended this and 130 s
def test_the_run_rides_out_nats_server_gone_for_over_a_minute(tmp_path):
    report = chaos(CONFIG, seed=5, kills=1, services=("nats",), runs_root=tmp_path, progress=False, nats_outage=65.0)
    check(report, "nats")
    assert report["kills"][0]["down_seconds"] == 65.0
    assert report["wall_seconds"] > 65


@pytest.mark.extended  # ~2 min; tests/launcher/test_nats_cluster.py keeps an R3 stream through a node down
def test_losing_a_node_of_a_three_node_cluster_loses_nothing(tmp_path):
    report = chaos(CONFIG, seed=7, kills=1, services=("nats",), runs_root=tmp_path, progress=False,
                   nats_mode="cluster")
    check(report, "nats")
    assert report["nats_mode"] == "cluster"


@pytest.mark.extended  # ~1 min; tests/common/test_single_active.py's [builder] case covers the takeover in make test
def test_a_second_builder_stands_by_and_takes_over_when_the_active_one_is_killed(tmp_path):
    """Two builders on one config (one gRPC port: an instance binds it only once it holds the lease); the active one
    is SIGKILLed, the standby takes over, the supervisor's restart of the killed one becomes the new standby."""
    report = chaos(CONFIG, seed=11, kills=1, services=("builder",), standby=("builder",), runs_root=tmp_path,
                   progress=False)
    assert report["passed"], report["violations"]
    assert report["completed"] and report["steps"] == 16
    assert report["groups_lost"] == 0 and report["duplicate_trajectories_trained"] == 0
    kill = report["kills"][0]
    assert [k["service"] for k in report["kills"]] == ["builder"] and kill["settled"], report["kills"]
    killed, survivor = kill["instance"], kill["active_after"]
    assert {killed, survivor} == {"builder", "builder-standby"}, kill
    assert report["restarts"]["builder"] == (killed == "builder")  # the standby's restarts are its own
    first, second = report["lease_events"][killed], report["lease_events"][survivor]
    assert first[:2] == ["lease_acquired", "serving"] and first.count("serving") == 1, first
    assert "lease_standby" in first[2:], f"the restarted builder did not stand by: {first}"
    assert "lease_standby" in second and second.index("lease_standby") < second.index("serving"), second
    assert second.count("serving") == 1, second


SMALL_BYTES = "configs/chaos-small-bytes.yaml"  # nats_max_bytes = MIN_MAX_BYTES (64 MiB): TRAJ ~19 MiB


@pytest.mark.extended  # ~1 min
def test_traj_at_its_byte_cap_on_the_least_budget_keeps_the_invariant(tmp_path):
    """TRAJ filled to 90% of its cap before the run (old, consumed trajectories), so the run's own push it past the
    cap and DiscardOld deletes the oldest; the builder is killed meanwhile (its held trajectories come back by
    redelivery, which a deleted message never would)."""
    report = chaos(SMALL_BYTES, seed=3, kills=1, services=("builder",), runs_root=tmp_path, progress=False, fill=0.9)
    traj = report["traj"]
    assert traj["max_bytes"] == int(0.3 * (64 << 20)) and "filler_error" not in traj, traj
    assert traj["discarded_messages"] > 0 and traj["bytes"] > 0.9 * traj["max_bytes"], traj  # it was at its cap
    check(report, "builder")


@pytest.mark.extended
def test_the_run_rides_out_nats_down_longer_than_the_dedupe_window(tmp_path):
    """130 s without nats-server, past JetStream's 120 s dedupe window: a publish whose copy was stored just before
    the kill and is retried after the restart (PUBLISH_DEADLINE 300 s) is stored again; the builder's dedupe by
    trajectory and group, and batches written once per index, must keep the invariant anyway."""
    report = chaos(CONFIG, seed=5, kills=1, services=("nats",), runs_root=tmp_path, progress=False, nats_outage=130.0)
    check(report, "nats")
    assert report["kills"][0]["down_seconds"] == 130.0
    assert report["wall_seconds"] > 130
