"""Serving the app with uvicorn inside the caller's event loop, until `stop` is set.

While it serves with a generated admin key, a discovery note `<runtime dir>/gateway-<port>.json` (the user's
own directory, 0700; `MESHRL_RUNTIME_DIR` or `~/.cache/meshrl/runtime`) names the key's file, never the key, so
local tools (the example agents) find the key a loopback gateway uses; it is removed when the gateway stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from services.common.logging import get_logger
from services.rollout.gateway.config import GatewayConfig, ensure_admin_key

RUNTIME_DIR_ENV = "MESHRL_RUNTIME_DIR"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the hosting service owns SIGTERM / SIGINT
        yield


def runtime_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(RUNTIME_DIR_ENV) or pathlib.Path.home() / ".cache" / "meshrl" / "runtime")


def _write_note(port: int, host: str, key_file: pathlib.Path) -> pathlib.Path | None:
    """The discovery note of a gateway serving a generated key (its path only); None when it cannot be written."""
    try:
        folder = runtime_dir()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        note = folder / f"gateway-{port}.json"
        tmp = note.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump({"url": f"http://{host}:{port}", "admin_key_file": str(key_file.resolve()), "pid": os.getpid()}, out)
        os.replace(tmp, note)
        return note
    except OSError as exc:
        get_logger().warning("gateway_note_failed", error=str(exc))
        return None


async def serve_gateway(app: Starlette, config: GatewayConfig, stop: asyncio.Event) -> None:
    key_file = getattr(app.state, "admin_key_file", None)
    if not config.admin_key:
        key_file = ensure_admin_key(config)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                                    lifespan="on", timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve(), name="gateway-uvicorn")
    while not server.started and not task.done() and not stop.is_set():
        await asyncio.sleep(0.01)
    note = None
    if server.started and server.servers:
        app.state.port = server.servers[0].sockets[0].getsockname()[1]
        get_logger().info("gateway_serving", url=f"http://{config.host}:{app.state.port}",
                          admin_key_file=str(key_file) if key_file else None)
        if key_file is not None:
            note = _write_note(app.state.port, config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1",
                               pathlib.Path(key_file))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if note is not None:
            with contextlib.suppress(OSError):
                note.unlink()
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
