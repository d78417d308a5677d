"""Session routes: /rl/start_session (admin key), /rl/set_reward and /rl/end_session (session key), status."""

from __future__ import annotations

import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from services.rollout.gateway import fields as f
from services.rollout.gateway import lifecycle
from services.rollout.gateway.core import Gateway
from services.rollout.gateway.errors import ApiError
from services.rollout.gateway.http import api_key, json_response, read_json
from services.rollout.gateway.session import Session

_START_KEYS = frozenset({"task_id", "group_size", "api_key", "metadata"})


# sessions live in the memory of the gateway replica that started them
GONE = ("; if the gateway restarted since the session started, the session is gone: start a new episode "
        "(POST /rl/start_session)")


def add_rl_routes(app: Starlette, gw: Gateway) -> None:
    cfg = gw.config
    idempotent: dict[str, tuple[float, dict]] = {}

    def require_admin(request: Request) -> None:
        token = api_key(request)
        if not token:
            raise ApiError(401, "missing admin key: send it as 'Authorization: Bearer <key>'")
        if not gw.is_admin(token):
            raise ApiError(401, "this route needs the admin key")

    def target_session(request: Request, body: dict) -> Session:
        """A session key names its session (ended ones too); the admin key names one by session_id."""
        token = api_key(request)
        if not token:
            raise ApiError(401, "missing API key: send the session key as 'Authorization: Bearer <key>'")
        if gw.is_admin(token):
            session_id = f.string(body, "session_id")
            session = gw.sessions.by_id(session_id)
            if session is None:
                raise ApiError(404, f"session_id: {session_id!r} is not a known session{GONE}", param="session_id")
            return session
        session = gw.sessions.by_key(token)
        if session is None:
            raise ApiError(401, f"unknown API key: not a session key of this gateway{GONE}")
        return session

    async def start_session(request: Request) -> Response:
        require_admin(request)
        body, _ = await read_json(request, cfg.max_body_bytes)
        f.check_keys(body, _START_KEYS, frozenset(), strict=True)
        idem = request.headers.get("idempotency-key")
        if idem and idem in idempotent and time.monotonic() - idempotent[idem][0] < cfg.idempotency_ttl_s:
            return json_response(idempotent[idem][1], 201)
        metadata = body.get("metadata") or {}
        result = await lifecycle.start_session(
            gw, task_id=f.string(body, "task_id", allow_empty=False),
            group_size=f.integer(body, "group_size", default=1, lo=1, hi=cfg.max_sessions),
            api_key=f.string(body, "api_key", default=None, allow_empty=False), metadata=f.obj(metadata, "metadata"))
        if idem:
            idempotent[idem] = (time.monotonic(), result)
        return json_response(result, 201)

    async def set_reward(request: Request) -> Response:
        body, _ = await read_json(request, cfg.max_body_bytes)
        session = target_session(request, body)
        f.req(body, "reward")
        reward = f.number(body, "reward", default=0.0)
        return json_response(lifecycle.set_reward(session, reward, f.string(body, "interaction_id", default=None)))

    async def end_session(request: Request) -> Response:
        body, _ = await read_json(request, cfg.max_body_bytes, allow_empty=True)
        session = target_session(request, body)
        return json_response(await lifecycle.end_session(gw, session))

    async def status(request: Request) -> Response:
        require_admin(request)
        return json_response({"sessions_active": len(gw.sessions.active), "inflight": gw.inflight,
                              "requests": gw.requests, "replayed": gw.replayed, "rejected_busy": gw.rejected_busy,
                              "published": gw.outbox.published, "publish_pending": gw.outbox.pending,
                              "engine_paused": bool(gw.backend.engine.paused), "policy_version": gw.backend.version,
                              "export_mode": cfg.export_mode, "budget": gw.budget.snapshot()})

    async def session_info(request: Request) -> Response:
        require_admin(request)
        session = gw.sessions.by_id(request.path_params["session_id"])
        if session is None:
            raise ApiError(404, f"session not found{GONE}", param="session_id")
        return json_response({
            "session_id": session.id, "task_id": session.task_id, "group_id": session.group_id,
            "state": session.state.value, "end_reason": session.end_reason, "trajectories": session.exported,
            "interaction_count": session.interaction_count,
            "interactions": [{"id": i.id, "parent_id": i.parent_id, "api": i.api, "prompt_tokens": len(i.prompt_ids),
                              "completion_tokens": len(i.output_ids), "reused_prompt_tokens": i.sampling.get("reused_prompt_tokens", 0),
                              "finish_reason": i.finish_reason, "reward": i.reward} for i in session.interactions]})

    async def health(request: Request) -> Response:
        return json_response({"status": "ok", "paused": bool(gw.backend.engine.paused), "version": gw.backend.version})

    app.add_route("/rl/start_session", start_session, methods=["POST"])
    app.add_route("/rl/set_reward", set_reward, methods=["POST"])
    app.add_route("/rl/end_session", end_session, methods=["POST"])
    app.add_route("/rl/status", status, methods=["GET"])
    app.add_route("/rl/sessions/{session_id}", session_info, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/healthz", health, methods=["GET"])
