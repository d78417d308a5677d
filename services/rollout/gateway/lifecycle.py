"""Session lifecycle on top of the gateway: start (and refresh), reward, end and export, idle reaping, shutdown."""

from __future__ import annotations

import asyncio
import time

from services.common.ids import now
from services.common.logging import get_logger
from services.rollout.gateway import metrics
from services.rollout.gateway.core import Gateway
from services.rollout.gateway.errors import ApiError, bad_request
from services.rollout.gateway.export import export_session
from services.rollout.gateway.session import Session, SessionState


async def start_session(gw: Gateway, *, task_id: str, group_size: int, api_key: str | None, metadata: dict) -> dict:
    if api_key is not None:
        if gw.is_admin(api_key):
            raise bad_request("api_key", "must not be the admin key")
        if group_size > 1:
            raise bad_request("api_key", "a fixed api_key names one session; use group_size 1 or omit api_key")
        previous = gw.sessions.by_key(api_key)
        if previous is not None and previous.active:
            await end_session(gw, previous, reason="refreshed")  # reward 0 unless one was set
    try:
        sessions = gw.sessions.create_group(task_id=task_id, group_size=group_size, api_key=api_key, metadata=metadata)
    except OverflowError as exc:
        raise ApiError(429, str(exc), headers={"retry-after": "5"}) from exc
    metrics.SESSIONS.labels("started").inc(len(sessions))
    get_logger().info("gateway_session_started", group_id=sessions[0].group_id, task_id=task_id, group_size=group_size)
    first = sessions[0]
    return {"group_id": first.group_id, "task_id": task_id, "group_size": group_size,
            "session_id": first.id, "api_key": first.api_key,
            "sessions": [{"session_id": s.id, "api_key": s.api_key, "session_api_key": s.api_key} for s in sessions]}


def set_reward(session: Session, reward: float, interaction_id: str | None) -> dict:
    if not session.active:
        raise ApiError(409, f"session {session.id} has ended; rewards can no longer change")
    try:
        targets = session.set_reward(reward, interaction_id)
    except ValueError as exc:
        raise bad_request("reward", str(exc).split(":", 1)[-1].strip()) from exc
    except KeyError as exc:
        raise bad_request("interaction_id", str(exc.args[0]).split(":", 1)[-1].strip()) from exc
    except LookupError as exc:
        raise ApiError(409, f"session {session.id}: {exc}; set the reward after a model call") from exc
    return {"session_id": session.id, "interaction_ids": [t.id for t in targets], "reward": reward}


async def end_session(gw: Gateway, session: Session, *, reason: str = "ended", force: bool = False) -> dict:
    """Idempotent and safe under concurrency: the first call exports; calls racing it wait for the same end, later
    ones report its result. 429 (the session stays active) while the outbox is full, unless `force` (shutdown)."""
    if session.active:
        if session.ending is None:
            session.ending = asyncio.ensure_future(_end(gw, session, reason, force))
        ending = session.ending
        try:
            await asyncio.shield(ending)
        except BaseException:
            if session.ending is ending and ending.done():
                session.ending = None  # it failed before the session changed: a later call tries again
            raise
    return {"session_id": session.id, "state": session.state.value, "end_reason": session.end_reason,
            "interaction_count": session.interaction_count, "trajectories": session.exported,
            "published": all(f.done() for f in session.exports)}


async def _end(gw: Gateway, session: Session, reason: str, force: bool) -> None:
    await _drain(gw, session)
    defaulted = bool(session.interactions) and all(i.reward is None for i in session.interactions)
    if defaulted:
        session.interactions[-1].reward = 0.0
    session.end_reason = reason  # the export's metadata carries it
    trajectories = export_session(session, mode=gw.config.export_mode, gamma=gw.config.turn_discount)
    if not force and not gw.outbox.has_room(len(trajectories)):
        session.end_reason = ""
        if defaulted:
            session.interactions[-1].reward = None
        raise ApiError(429, f"{gw.outbox.pending} trajectories are waiting for the bus (the most the gateway holds "
                            f"is {gw.outbox.max_pending}); the session stays active: end it again later",
                       code="rate_limit_exceeded", headers={"retry-after": "5", "retry-after-ms": "5000"})
    session.transition(SessionState.ENDED, reason)
    session.exported = len(trajectories)
    own = sum(t.group_id == session.group_id for t in trajectories)
    gw.budget.end(session.group_id, session.group_size, exported=own > 0, extra=len(trajectories) - own)
    gw.recorded_tokens -= session.tokens
    session.release()
    gw.replays.forget_session(session.id)
    metrics.SESSIONS.labels(reason).inc()
    metrics.TRAJECTORIES.inc(len(trajectories))
    session.exports = gw.enqueue(trajectories)
    if session.exports:
        await asyncio.wait(session.exports, timeout=gw.config.publish_timeout_s)
    get_logger().info("gateway_session_ended", session_id=session.id, reason=reason,
                      interactions=session.interaction_count, trajectory_ids=[t.trajectory_id for t in trajectories])


async def _drain(gw: Gateway, session: Session) -> None:
    """Let the session's requests in flight finish (bounded), so their interactions are part of the export."""
    deadline = time.monotonic() + gw.config.publish_timeout_s
    while session.inflight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(gw.config.poll_interval_s)


async def reap(gw: Gateway, stop: asyncio.Event) -> None:
    """End sessions idle past the timeout; forget ended ones after the replay window."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), gw.config.reap_interval_s)
        except TimeoutError:
            pass
        for session in gw.sessions.idle(now() - gw.config.idle_timeout_s):
            if session.inflight == 0:
                try:
                    await end_session(gw, session, reason="idle")
                except ApiError as exc:  # the outbox is full: the next round tries again
                    get_logger().warning("gateway_reap_deferred", session_id=session.id, error=exc.message)
                    break
        gw.sessions.prune(now() - gw.config.ended_ttl_s)


async def shutdown(gw: Gateway) -> None:
    """End every active session (exported with the rewards set so far), then flush the outbox."""
    for session in gw.sessions.active:
        try:
            await end_session(gw, session, reason="shutdown", force=True)
        except ApiError:  # it shared an end that found the outbox full: end it again, forced
            await end_session(gw, session, reason="shutdown", force=True)
    await gw.outbox.close(gw.config.publish_timeout_s)
    gw.offload.close()
