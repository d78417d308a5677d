"""The staleness budget for agent groups: the pure GroupBudget, then through a real gateway over HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client import REGISTRY

from services.rollout.gateway.budget import GroupBudget
from tests.gateway.harness import ADMIN, GatewayServer
from tests.gateway.policies import random_engine

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
pytestmark = pytest.mark.timeout(120)


# pure ------------------------------------------------------------------------------------------------------
def test_unlimited_until_the_first_announcement_which_counts_groups_already_admitted():
    b = GroupBudget()
    assert all(b.admit(f"g{i}", 1) for i in range(5)) and b.capacity() is None
    b.update(limit=6)
    assert b.capacity() == 1 and b.admit("g5", 1) and not b.admit("g6", 1)
    assert b.admit("g0", 1) and b.admitted == 6, "an admitted group is never refused nor counted twice"


def test_capacity_is_limit_plus_released_minus_admitted_or_arrived():
    b = GroupBudget()
    b.update(limit=2)
    assert b.admit("a", 1) and b.admit("b", 1) and not b.admit("c", 1)
    b.update(limit=2, released=1)            # the builder dropped one online group as stale
    assert b.capacity() == 1 and b.admit("c", 1) and b.capacity() == 0
    b.update(limit=4, released=1, arrived=5)  # more arrived than admitted here (e.g. after a restart)
    assert b.capacity() == 0
    b.update(limit=1, released=0, arrived=0)  # announcements never shrink it (a restarted builder)
    assert (b.limit, b.released, b.arrived) == (4, 1, 5)


def test_a_group_that_never_reaches_the_builder_frees_its_slot():
    b = GroupBudget()
    b.update(limit=10)
    b.admit("whole", 2)
    b.end("whole", 2, exported=True)
    b.end("whole", 2, exported=True)
    b.admit("empty", 2)
    b.end("empty", 2, exported=False)
    assert b.admitted == 2, "a group is released only once all its sessions ended"
    b.end("empty", 2, exported=False)
    b.admit("partial", 2)
    b.end("partial", 2, exported=True)
    b.end("partial", 2, exported=False)  # the builder waits for 2 members forever: never trained
    assert b.admitted == 1 and b.capacity() == 9
    b.end("never-admitted", 1, exported=False)
    assert b.admitted == 1


def test_extra_groups_a_session_exports_count_as_admitted():
    b = GroupBudget()
    b.update(limit=3)
    b.admit("g", 1)
    b.end("g", 1, exported=False, extra=3)  # "interaction" export: every call is its own group
    assert b.admitted == 3 and b.capacity() == 0


@pytest.mark.parametrize("field", ["limit", "released", "arrived"])
def test_negative_announcement_names_the_field(field):
    with pytest.raises(ValueError, match=field):
        GroupBudget().update(**{"limit": 1, field: -1})


# over HTTP -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gw(tok):
    server = GatewayServer(random_engine(tok, seed=5), tok, max_wait_s=0.6, retry_after_s=1.0,
                           default_max_tokens=8).start()
    yield server
    server.stop()


def post(gw, key: str, body: dict = BODY) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})


def budget(gw) -> dict:
    return gw.admin("GET", "/rl/status").json()["budget"]


def test_budget_admits_n_groups_then_429_but_admitted_sessions_continue(gw):
    assert REGISTRY.get_sample_value("meshrl_gateway_capacity_groups") == -1.0, "unlimited before any budget event"
    gw.on_loop(gw.gateway.budget.update, limit=2)
    pair = [s["api_key"] for s in gw.start_session(group_size=2)["sessions"]]
    one = gw.start_session()["api_key"]
    assert post(gw, pair[0]).status_code == 200 and post(gw, one).status_code == 200
    assert budget(gw)["capacity"] == 0 and REGISTRY.get_sample_value("meshrl_gateway_capacity_groups") == 0.0

    third = gw.start_session()["api_key"]
    t0 = time.monotonic()
    r = post(gw, third)
    assert r.status_code == 429 and time.monotonic() - t0 >= 0.6
    assert r.headers["retry-after"] == "1" and r.headers["x-meshrl-paused"] == "0"
    assert "staleness budget" in r.json()["error"]["message"] and r.json()["error"]["type"] == "rate_limit_error"

    assert post(gw, one).status_code == 200, "a session's second request never waits for the budget"
    assert post(gw, pair[1]).status_code == 200, "nor does the first request of an admitted group's other session"
    admin = httpx.post(gw.url + "/v1/chat/completions", json=BODY, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 200 and budget(gw)["admitted"] == 2

    # a budget event raising the limit lets a waiting request through
    gw.gateway.backend.max_wait_s = 30.0
    try:
        seen = gw.gateway.requests
        result: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: result.append(post(gw, third)), daemon=True)
        waiter.start()
        deadline = time.monotonic() + 20
        while gw.gateway.requests <= seen:
            assert time.monotonic() < deadline, "the request never reached the gateway"
            time.sleep(0.01)
        time.sleep(0.2)
        assert waiter.is_alive() and not result, "the new group waits while the budget is spent"
        gw.on_loop(gw.gateway.budget.update, limit=3)
        waiter.join(30)
    finally:
        gw.gateway.backend.max_wait_s = 0.6
    assert result and result[0].status_code == 200 and budget(gw)["capacity"] == 0


def test_ending_sessions_frees_slots_only_for_groups_that_exported_nothing(gw):
    gw.on_loop(gw.gateway.budget.update, limit=gw.gateway.budget.admitted + 1)
    failed = gw.start_session()["api_key"]
    too_long = {**BODY, "messages": [{"role": "user", "content": "x " * 5000}]}
    assert post(gw, failed, too_long).status_code == 400  # admitted first, then refused: nothing recorded
    assert budget(gw)["capacity"] == 0
    gw.session_post(failed, "/rl/end_session")
    assert budget(gw)["capacity"] == 1, "an admitted group that exported nothing frees its slot"

    done = gw.start_session()["api_key"]
    assert post(gw, done).status_code == 200
    gw.session_post(done, "/rl/end_session")
    assert budget(gw)["capacity"] == 0, "an exported group keeps its slot until the builder releases it"
    late = gw.start_session()["api_key"]
    assert post(gw, late).status_code == 429
    gw.on_loop(gw.gateway.budget.update, limit=budget(gw)["limit"], released=1)
    assert post(gw, late).status_code == 200
