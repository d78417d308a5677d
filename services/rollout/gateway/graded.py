"""Sessions graded by a verifier, and the tools the reward service runs for agents: their HTTP edges.

`POST /rl/start_session` may carry `grading` (the keys a dataset row's grading takes: `verifier`, `answer`, a code
task's `tests` and `entry_point`, ...): the session's trajectories then go through the reward service (traj.raw)
instead of straight to the builder, and the verifier's reward replaces the agent's (`add_reward: true` adds the
agent's on top). Unless it says otherwise (`response`), the verifier grades the session's last answer only.

`POST /rl/run_code` (a session key): the agent's program runs in the reward service's sandbox, the one the code
verifiers use; the reply is the run's outcome. Nothing is recorded: the agent sends the result back as a tool
message, which the next model call's prompt carries (loss mask 0).
"""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from services.common import grading
from services.common.contracts import data_pb2
from services.common.errors import FieldError
from services.common.ids import now
from services.rollout.gateway import fields as f
from services.rollout.gateway.errors import ApiError, bad_request
from services.rollout.gateway.http import json_response

_RUN_KEYS = frozenset({"code", "language", "stdin", "timeout_s"})
MAX_CODE_CHARS = 256 * 1024


def session_grading(value: Any, verifiers: frozenset[str] | None) -> data_pb2.Grading:
    """`grading` of a start_session body as the message that travels; 400 naming `grading.<key>`. `verifiers`: the
    names the reward service knows (None: not checked here, the reward service refuses an unknown one)."""
    task = f.obj(value, "grading")
    try:
        g = grading.to_proto(task)
    except FieldError as exc:
        raise bad_request(exc.field, exc.problem) from exc
    if not g.verifier:
        raise bad_request("grading.verifier", "required: the verifier that grades the session (e.g. exact, math, "
                                              "code_tests)")
    if verifiers is not None and g.verifier not in verifiers:
        raise bad_request("grading.verifier", f"unknown {g.verifier!r} (GET the reward service's ListVerifiers for "
                                              "the known names)")
    if not g.response:
        g.response = "final_turn"  # an agent's answer is its last turn; tool results and earlier turns are context
    return g


def add_tool_routes(app: Starlette, gw: Any, identify, body_of) -> None:
    async def run_code(request: Request) -> Response:
        session = identify(request)
        if session is None:
            raise ApiError(403, "run_code takes a session key (the run belongs to an episode)")
        if gw.reward is None:
            raise ApiError(501, "run_code: this gateway has no reward service to run code in (rollout's "
                                "reward_address is empty)", code="unsupported")
        if not session.active or session.ending is not None:
            raise ApiError(409, f"session {session.id} has ended; start a new one with /rl/start_session")
        body = await body_of(request)
        f.check_keys(body, _RUN_KEYS, frozenset(), strict=True)
        code = f.string(body, "code", allow_empty=False)
        if len(code) > MAX_CODE_CHARS:
            raise bad_request("code", f"longer than {MAX_CODE_CHARS} characters")
        language = f.string(body, "language", default="python", allow_empty=False)
        stdin = f.string(body, "stdin", default="")
        timeout_s = f.number(body, "timeout_s", default=0.0, lo=0.0)  # 0: the sandbox's own limit
        session.last_active = now()
        session.inflight += 1  # an end waits for it, an idle reaper skips it
        try:
            run = await gw.reward.run_code(code, language=language, stdin=stdin.encode(), timeout_s=timeout_s)
        except FieldError as exc:
            raise bad_request(exc.field, exc.problem) from exc
        except ValueError as exc:
            raise bad_request("code", str(exc)) from exc
        except RuntimeError as exc:  # RewardUnavailable: not the agent's fault, it may retry
            raise ApiError(503, f"run_code: {exc}", headers={"retry-after": "1"}) from exc
        finally:
            session.inflight -= 1
        gw.code_runs += 1
        return json_response(run.to_json())

    app.add_route("/rl/run_code", run_code, methods=["POST"])
