"""Session routes: /rl/start_session (admin key), /rl/set_reward and /rl/end_session (session key),
/rl/set_preference (admin key: a person's label between two episodes of a group), status; the tools the reward
service runs for agents (/rl/run_code) in graded.py."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from services.rollout.gateway import fields as f
from services.rollout.gateway import lifecycle
from services.rollout.gateway.core import Gateway
from services.rollout.gateway.dedupe import IdempotencyCache
from services.rollout.gateway.errors import ApiError, bad_request
from services.rollout.gateway.graded import add_tool_routes, session_grading
from services.rollout.gateway.http import api_key, json_response, load_json, read_body
from services.rollout.gateway.session import Session

_START_KEYS = frozenset({"task_id", "group_size", "api_key", "metadata", "grading"})
MAX_NAME_CHARS = 1024


# sessions live in the memory of the gateway replica that started them
GONE = ("; if the gateway restarted since the session started, the session is gone: start a new episode "
        "(POST /rl/start_session)")


def add_rl_routes(app: Starlette, gw: Gateway) -> None:
    cfg = gw.config
    idempotent = gw.idempotency
    fixed_keys = asyncio.Lock()  # restarts with a fixed api_key, one at a time (the old session ends first)

    def require_admin(request: Request) -> None:
        token = api_key(request)
        if not token:
            raise ApiError(401, "missing admin key: send it as 'Authorization: Bearer <key>'")
        if not gw.is_admin(token):
            raise ApiError(401, "this route needs the admin key")

    def identify(request: Request) -> Session | None:
        """Authenticate from the headers alone, before any body is read: a session key names its session (ended
        ones too); None: the admin key (the body names the session)."""
        token = api_key(request)
        if not token:
            raise ApiError(401, "missing API key: send the session key as 'Authorization: Bearer <key>'")
        if gw.is_admin(token):
            return None
        session = gw.sessions.by_key(token)
        if session is None:
            raise ApiError(401, f"unknown API key: not a session key of this gateway{GONE}")
        return session

    def named_session(body: dict, caller: Session | None) -> Session:
        """The session a call acts on: the caller's own (a session key), or the one the body names (the admin key).
        A session key naming another session is refused: one agent's key never touches another's episode."""
        if caller is not None:
            named = body.get("session_id")
            if named is not None and named != caller.id:
                raise ApiError(403, f"session_id: this key belongs to session {caller.id}, not {named!r}",
                               param="session_id")
            return caller
        session_id = f.string(body, "session_id")
        session = gw.sessions.by_id(session_id)
        if session is None:
            raise ApiError(404, f"session_id: {session_id!r} is not a known session{GONE}", param="session_id")
        return session

    async def body_of(request: Request, *, allow_empty: bool = False) -> dict:
        raw = await read_body(request, cfg.max_body_bytes)
        return await gw.offload.run(len(raw), lambda: load_json(raw, max_depth=cfg.max_json_depth,
                                                                allow_empty=allow_empty))

    async def start_session(request: Request) -> Response:
        require_admin(request)
        if not cfg.sessions_enabled:
            raise ApiError(403, "this gateway serves a frozen model (never trained): call its model routes with the "
                                "admin key; sessions are the policy's gateway's")
        body = await body_of(request)
        f.check_keys(body, _START_KEYS, frozenset(), strict=True)
        task_id = f.string(body, "task_id", allow_empty=False)
        if len(task_id) > MAX_NAME_CHARS:
            raise bad_request("task_id", f"longer than {MAX_NAME_CHARS} characters")
        group_size = f.integer(body, "group_size", default=1, lo=1, hi=cfg.max_sessions)
        fixed = f.string(body, "api_key", default=None, allow_empty=False)
        if fixed is not None and (len(fixed) > 256 or not fixed.isprintable() or any(c.isspace() for c in fixed)):
            raise bad_request("api_key", "must be at most 256 printable characters without whitespace")
        metadata = f.obj(body.get("metadata") or {}, "metadata")
        graded = None
        if body.get("grading") is not None:
            graded = session_grading(body["grading"], await known_verifiers())
        idem = request.headers.get("idempotency-key")
        token = None
        if idem:
            if len(idem) > IdempotencyCache.MAX_KEY_CHARS:
                raise bad_request("Idempotency-Key", f"longer than {IdempotencyCache.MAX_KEY_CHARS} characters")
            while (first := idempotent.lookup(idem)) is not None:  # a repeat: the first call's answer
                result = await asyncio.shield(first)
                if result is not None:
                    return json_response(result, 201)
            token = idempotent.begin(idem)
        try:
            async with fixed_keys if fixed is not None else contextlib.nullcontext():
                result = await lifecycle.start_session(gw, task_id=task_id, group_size=group_size, api_key=fixed,
                                                       metadata=metadata, grading=graded)
        except BaseException:
            if token is not None:
                idempotent.fail(idem, token)
            raise
        if token is not None:
            idempotent.resolve(idem, token, result)
        return json_response(result, 201)

    async def known_verifiers() -> frozenset[str] | None:
        if gw.reward is None:
            return None  # no reward service to ask here: it refuses an unknown verifier when it scores
        try:
            return await gw.reward.verifiers()
        except RuntimeError as exc:
            raise ApiError(503, f"grading.verifier: cannot be checked now ({exc})", headers={"retry-after": "1"},
                           param="grading.verifier") from exc

    async def set_reward(request: Request) -> Response:
        session = identify(request)
        body = await body_of(request)
        session = named_session(body, session)
        f.req(body, "reward")
        reward = f.number(body, "reward", default=0.0)
        interaction_id = f.string(body, "interaction_id", default=None)
        return json_response(lifecycle.set_reward(session, reward, interaction_id, max_abs=cfg.max_abs_reward))

    async def set_preference(request: Request) -> Response:
        """A person's label between two episodes of one group (admin key: a labelling tool, never an agent):
        `chosen` gets reward 1 and `rejected` 0, on their last turns, and both end (`end`: true, the default), so
        the pair is exported for a pairwise preset (dpo) to take the one over the other."""
        require_admin(request)
        body = await body_of(request)
        f.check_keys(body, frozenset({"chosen", "rejected", "end"}), frozenset(), strict=True)
        pair = []
        for name in ("chosen", "rejected"):
            session_id = f.string(body, name, allow_empty=False)
            session = gw.sessions.by_id(session_id)
            if session is None:
                raise ApiError(404, f"{name}: {session_id!r} is not a known session{GONE}", param=name)
            pair.append(session)
        chosen, rejected = pair
        if chosen.id == rejected.id:
            raise bad_request("rejected", "is the chosen session itself: a preference compares two episodes")
        if chosen.group_id != rejected.group_id:
            raise bad_request("rejected", f"session {rejected.id} is in group {rejected.group_id}, the chosen one in "
                              f"{chosen.group_id}: a preference compares two episodes of one task (one group)")
        for session in pair:      # both can still take a reward, before either is set
            if not session.active or session.ending is not None:
                raise ApiError(409, f"session {session.id} has ended; its reward can no longer change")
        results = [lifecycle.set_reward(session, reward, None, max_abs=cfg.max_abs_reward)
                   for session, reward in ((chosen, 1.0), (rejected, 0.0))]
        if f.boolean(body, "end", default=True):
            for session in pair:
                await lifecycle.end_session(gw, session)
        return json_response({"group_id": chosen.group_id, "chosen": results[0], "rejected": results[1]})

    async def end_session(request: Request) -> Response:
        session = identify(request)
        body = await body_of(request, allow_empty=True)
        session = named_session(body, session)
        return json_response(await lifecycle.end_session(gw, session))

    async def status(request: Request) -> Response:
        require_admin(request)
        return json_response({"sessions_active": len(gw.sessions.active), "inflight": gw.inflight,
                              "requests": gw.requests, "replayed": gw.replayed, "rejected_busy": gw.rejected_busy,
                              "published": gw.outbox.published, "publish_pending": gw.outbox.pending,
                              "engine_paused": bool(gw.backend.engine.paused), "policy_version": gw.backend.version,
                              "export_mode": cfg.export_mode, "budget": gw.budget.snapshot(),
                              "bounds": {"replay_entries": len(gw.replays), "idempotency_keys": len(gw.idempotency),
                                         "recorded_tokens": gw.recorded_tokens, "heavy_pending": gw.offload.pending,
                                         "heavy_rejected": gw.offload.rejected}})

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

    add_tool_routes(app, gw, identify, body_of)
    app.add_route("/rl/start_session", start_session, methods=["POST"])
    app.add_route("/rl/set_reward", set_reward, methods=["POST"])
    app.add_route("/rl/set_preference", set_preference, methods=["POST"])
    app.add_route("/rl/end_session", end_session, methods=["POST"])
    app.add_route("/rl/status", status, methods=["GET"])
    app.add_route("/rl/sessions/{session_id}", session_info, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/healthz", health, methods=["GET"])
