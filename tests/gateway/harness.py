"""A real gateway on loopback: uvicorn in its own thread and event loop, a real EmbeddedEngine behind it; the
reward service's gRPC servicer (for /rl/run_code) likewise."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from launcher.processes import free_port
from services.common import rpc
from services.common.bus import PayloadTooLarge
from services.common.contracts import data_pb2, reward_pb2, reward_pb2_grpc
from services.reward.sandbox import SandboxConfig
from services.reward.scoring import Scorer
from services.reward.server import RewardServicer
from services.rollout.gateway import GatewayConfig, create_app, serve_gateway

ADMIN = "test-admin-key"


class GatewayServer:
    def __init__(self, engine: Any, tokenizer: Any, *, admin_key: str = ADMIN, run_dir: Any = None, reward: Any = None,
                 vision: Any = None, **config: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.published: list[data_pb2.Trajectory] = []
        self.messages: list[list[str]] = []  # each publish: its members' trajectory ids
        self.publish_fails = 0               # the next N publishes raise (a bus outage)
        self.max_payload = 0                 # > 0: a trajectory over this many bytes is refused as the bus does
        self.hold_publish = threading.Event()  # set: publishes wait (a slow bus) until it is cleared (at most 60 s)
        self.config = GatewayConfig(port=free_port(), admin_key=admin_key, **config)
        self.app = create_app(self.config, engine, tokenizer, self._publish, run_dir=run_dir, reward=reward,
                              vision=vision)
        self.gateway = self.app.state.gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="gateway-test-server", daemon=True)
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    async def _publish(self, members: list[data_pb2.Trajectory]) -> None:
        deadline = time.monotonic() + 60
        while self.hold_publish.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError("publish held for 60 s")
            await asyncio.sleep(0.01)
        for traj in members:
            if self.max_payload and traj.ByteSize() > self.max_payload:
                raise PayloadTooLarge(f"meshrl.v1.Trajectory {traj.trajectory_id}: {traj.ByteSize()} bytes is over "
                                      f"the server's max_payload {self.max_payload}")
        if self.publish_fails > 0:
            self.publish_fails -= 1
            raise ConnectionError("bus unavailable")
        self.messages.append([t.trajectory_id for t in members])
        self.published.extend(members)

    def _serve(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await serve_gateway(self.app, self.config, self._stop)

        asyncio.run(main())

    def start(self) -> GatewayServer:
        self.engine.start()
        self._thread.start()
        self._started.wait(10)
        for _ in range(500):
            try:
                httpx.get(self.url + "/health", timeout=1).raise_for_status()
                return self
            except httpx.HTTPError:
                threading.Event().wait(0.02)
        raise RuntimeError("gateway did not start")

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.engine.stop()

    def on_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run fn on the gateway's event loop (where its state lives) and return its result."""
        async def call() -> Any:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(10)

    # admin helpers -----------------------------------------------------------------------------------------
    def admin(self, method: str, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN}", **(headers or {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, **kwargs)

    def start_session(self, task_id: str = "task-1", **body: Any) -> dict:
        r = self.admin("POST", "/rl/start_session", json={"task_id": task_id, **body})
        assert r.status_code == 201, r.text
        return r.json()

    def session_post(self, key: str, path: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body or {}, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    def session_info(self, session_id: str) -> dict:
        r = self.admin("GET", f"/rl/sessions/{session_id}")
        assert r.status_code == 200, r.text
        return r.json()


class RewardServer:
    """The reward service's gRPC servicer (its real Scorer and sandbox) on loopback, in a thread of its own."""

    def __init__(self) -> None:
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            servicer = RewardServicer(Scorer(lambda ids: "", "exact"), {"scored": 0.0, "reward_sum": 0.0}, None,
                                      SandboxConfig())
            self.server = await rpc.start_server("127.0.0.1:0", [rpc.Servicer(
                reward_pb2_grpc.add_RewardServiceServicer_to_server, servicer,
                reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name)])
            self.address = f"127.0.0.1:{self.server.port}"
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def start(self) -> RewardServer:
        self._thread.start()
        assert self._ready.wait(30), "the reward server did not start"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
