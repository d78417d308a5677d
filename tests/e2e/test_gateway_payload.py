"""An agent whose session overflows the NATS server's max_payload, against the real rollout service (its agent
gateway on) and a real nats-server: that session's end_session is 413 naming the size and the limit, and the other
agents' sessions, ended before and after it, are published to traj.scored (the outbox does not jam, F3).

Not a full agent run: the built-in tiny model has 256 positions, so no session it serves can reach the default
1 MiB max_payload (about 64k tokens of context); the server here runs with a max_payload that a long session of
that model overflows and a short one does not. The same code path refuses a 64k-token session at 1 MiB."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from launcher.processes import free_port, nats_server_binary, popen
from services.common import trajectory_groups
from services.common.bus import TYPE_HEADER

pytestmark = [pytest.mark.e2e]
ADMIN = "e2e-admin-key"
# the bus keeps 4 KiB of max_payload for headers: a trajectory over 560 bytes is refused. A one-line chat exports
# ~450 bytes (measured), a prompt near the model's 256 positions ~650 (about a byte a prompt token)
MAX_PAYLOAD = 4096 + 560
LONG = " ".join(f"{i}+{i}" for i in range(38))  # ~230 tokens of the character-level tokenizer, chat template included


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} within {timeout}s")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def small_nats(tmp_path):
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(json.dumps({"listen": f"127.0.0.1:{port}", "max_payload": MAX_PAYLOAD,
                                "jetstream": {"store_dir": str(tmp_path / "nats")}}))
    proc = popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: listening(port), 10, "nats-server listening")
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def gateway(small_nats, tmp_path, tiny_qwen3):
    port = free_port()
    config = {"nats_url": small_nats, "grpc_address": f"127.0.0.1:{free_port()}", "metrics_port": -1,
              "run_dir": str(tmp_path), "wx_address": "", "gateway_enabled": True,
              "gateway": {"port": port, "admin_key": ADMIN, "publish_timeout_s": 20.0},
              "engine": {"model_path": str(tiny_qwen3), "max_context": 256, "max_batch": 16, "torch_threads": 1}}
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "rollout.log", "wb")
    proc = popen([sys.executable, "-m", "services.rollout", "--config", str(path)], stdout=log,
                 stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, (tmp_path / "rollout.log").read_text()[-3000:]
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 180, "the rollout's gateway serving")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


class Agent:
    """One episode: a session, chat turns, a reward, end_session."""

    def __init__(self, url: str, task: str) -> None:
        self.url = url
        r = httpx.post(url + "/rl/start_session", json={"task_id": task}, headers={"Authorization": f"Bearer {ADMIN}"},
                       timeout=30)
        assert r.status_code == 201, r.text
        self.session_id, self.key = r.json()["session_id"], r.json()["api_key"]
        self.messages: list[dict] = []

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)

    def turn(self, content: str) -> None:
        self.messages.append({"role": "user", "content": content})
        r = self.post("/v1/chat/completions", {"model": "m", "messages": self.messages, "max_tokens": 8})
        assert r.status_code == 200, r.text
        self.messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})

    def end(self, reward: float | None = 1.0) -> httpx.Response:
        if reward is not None:
            assert self.post("/rl/set_reward", {"reward": reward}).status_code == 200
        return self.post("/rl/end_session", {})


async def scored_sessions(nats_url: str) -> list[str]:
    """The session (work) id of every trajectory on traj.scored."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        state = (await js.stream_info("TRAJ")).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            msg = await js.get_msg("TRAJ", seq)
            if msg.subject == "traj.scored":
                out.extend(t.work_id for t in trajectory_groups.parse(msg.headers[TYPE_HEADER], msg.data).trajectories)
        return out
    finally:
        await nc.close()


def test_a_session_over_max_payload_is_413_and_the_other_agents_are_published(gateway, small_nats):
    before, large, after = Agent(gateway, "small-0"), Agent(gateway, "large"), Agent(gateway, "small-1")
    before.turn("1+1")
    large.turn(LONG)  # the longest context the model holds: over this server's max_payload
    after.turn("2+2")
    ended = before.end()
    assert ended.status_code == 200 and ended.json()["published"], ended.text

    refused = large.end()
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "trajectory_too_large" and f"max_payload {MAX_PAYLOAD}" in error["message"], error

    started = time.monotonic()
    ended = after.end()
    assert ended.status_code == 200 and ended.json()["published"], ended.text
    assert time.monotonic() - started < 20, "the session after the refused one waited on it"
    assert large.end(reward=None).status_code == 413  # the same answer again

    scored = asyncio.run(scored_sessions(small_nats))
    assert sorted(scored) == sorted([before.session_id, after.session_id]), scored
