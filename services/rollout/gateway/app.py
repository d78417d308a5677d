"""The app factory: the lifespan owns the gateway's background work (outbox, reaper) and its shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from services.common.contracts import data_pb2
from services.common.logging import get_logger
from services.rollout.gateway import lifecycle
from services.rollout.gateway.budget import GroupBudget
from services.rollout.gateway.config import GatewayConfig, ensure_admin_key
from services.rollout.gateway.core import Gateway
from services.rollout.gateway.errors import ApiError
from services.rollout.gateway.http import error_response
from services.rollout.gateway.images import Vision
from services.rollout.gateway.routes_model import add_model_routes
from services.rollout.gateway.routes_rl import add_rl_routes


def create_app(config: GatewayConfig, engine: Any, tokenizer: Any,
               publish: Callable[[data_pb2.Trajectory], Awaitable[None]], budget: GroupBudget | None = None, *,
               run_dir: str | os.PathLike | None = None, reward: Any = None, vision: Vision | None = None) -> Starlette:
    """The gateway's app. Without a configured admin key, the key comes from (or is generated into, 0600) the key
    file under `run_dir` (see config.py); its path is logged once, the key never. `reward`: the reward service's
    client (`services.reward.client.RewardClient`) for /rl/run_code and graded sessions; None: neither. `vision`: a
    vision-language policy's image handling (gateway/images.py); None: messages with images are refused."""
    key_file = ensure_admin_key(config, run_dir)
    if key_file is not None:
        get_logger().info("gateway_admin_key", admin_key_file=str(key_file),
                          hint="send it as 'Authorization: Bearer <the file's content>' to /rl/start_session")
    gateway = Gateway(config, engine, tokenizer, publish, budget, reward, vision)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        stop = asyncio.Event()
        gateway.outbox.start()
        reaper = asyncio.create_task(lifecycle.reap(gateway, stop), name="gateway-reaper")
        try:
            yield
        finally:
            stop.set()
            await reaper
            await lifecycle.shutdown(gateway)

    async def api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc, request.url.path)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} not allowed"}
        return error_response(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))), request.url.path)

    async def unexpected(request: Request, exc: Exception) -> Response:
        get_logger().exception("gateway_unexpected_error", path=request.url.path, error=str(exc))
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}"), request.url.path)

    # plain Starlette: the routes parse their own bodies, so FastAPI's layers would only add per-request work
    app = Starlette(lifespan=lifespan, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                           Exception: unexpected})
    app.state.gateway = gateway
    app.state.admin_key_file = key_file
    add_model_routes(app, gateway)
    add_rl_routes(app, gateway)
    return app
