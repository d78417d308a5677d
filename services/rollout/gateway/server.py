"""Serving the app with uvicorn inside the caller's event loop, until `stop` is set."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from services.common.logging import get_logger
from services.rollout.gateway.config import DEV_ADMIN_KEY, GatewayConfig


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the hosting service owns SIGTERM / SIGINT
        yield


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve_gateway(app: Starlette, config: GatewayConfig, stop: asyncio.Event) -> None:
    if config.admin_key == DEV_ADMIN_KEY and not is_loopback(config.host):
        raise ValueError(f"admin_key: the development default may only serve on loopback, not {config.host!r}; "
                         "set MESHRL_ADMIN_KEY")
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                                    lifespan="on", timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve(), name="gateway-uvicorn")
    while not server.started and not task.done() and not stop.is_set():
        await asyncio.sleep(0.01)
    if server.started and server.servers:
        app.state.port = server.servers[0].sockets[0].getsockname()[1]
        get_logger().info("gateway_serving", url=f"http://{config.host}:{app.state.port}", dev_admin_key=config.uses_dev_admin_key)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopper.cancel()
    await task
    get_logger().info("gateway_stopped")


async def wait_started(app: Starlette, timeout: float = 10.0) -> int:
    """The bound port once uvicorn listens (useful with port 0)."""
    async with asyncio.timeout(timeout):
        while getattr(app.state, "port", None) is None:
            await asyncio.sleep(0.01)
    return app.state.port
