"""Session lifecycle on top of the gateway: start (and refresh), reward, end and export, idle reaping, shutdown.

Ending a session exports it once and queues its trajectories; the session ENDS (its key, tokens and budget slot
released) only once the bus has confirmed every one. Until then it is ending: model calls and rewards are 409,
and end_session answers 503 (Retry-After) past publish_timeout_s; calling it again waits for the same export.
An export that can never be published (too large) closes the session without one: 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time

from services.common.bus import PayloadTooLarge
from services.common.contracts import data_pb2
from services.common.ids import now
from services.common.logging import get_logger
from services.common.runtime import sleep_or_stop
from services.rollout.gateway import metrics
from services.rollout.gateway.core import Gateway
from services.rollout.gateway.errors import ApiError, bad_request
from services.rollout.gateway.export import check_rewards, export_session, oversize
from services.rollout.gateway.outbox import OutboxClosed
from services.rollout.gateway.session import Session, SessionState


async def start_session(gw: Gateway, *, task_id: str, group_size: int, api_key: str | None, metadata: dict,
                        grading: data_pb2.Grading | None = None) -> dict:
    if api_key is not None:
        if gw.is_admin(api_key):
            raise bad_request("api_key", "must not be the admin key")
        if group_size > 1:
            raise bad_request("api_key", "a fixed api_key names one session; use group_size 1 or omit api_key")
        previous = gw.sessions.by_key(api_key)
        if previous is not None and previous.active:
            try:
                await end_session(gw, previous, reason="refreshed")  # reward 0 unless one was set
            except ApiError:
                if previous.active:
                    raise  # not confirmed yet (503) or no room (429): the key stays with the old episode
                # else it was closed without an export (refused for good): the key is free for the new episode
    try:
        sessions = gw.sessions.create_group(task_id=task_id, group_size=group_size, api_key=api_key, metadata=metadata,
                                            grading=grading)
    except OverflowError as exc:
        raise ApiError(429, str(exc), headers={"retry-after": "5"}) from exc
    metrics.SESSIONS.labels("started").inc(len(sessions))
    get_logger().info("gateway_session_started", group_id=sessions[0].group_id, task_id=task_id, group_size=group_size,
                      verifier=grading.verifier if grading is not None else None)
    first = sessions[0]
    return {"group_id": first.group_id, "task_id": task_id, "group_size": group_size,
            "graded_by": grading.verifier if grading is not None else None,
            "session_id": first.id, "api_key": first.api_key,
            "sessions": [{"session_id": s.id, "api_key": s.api_key, "session_api_key": s.api_key} for s in sessions]}


def set_reward(session: Session, reward: float, interaction_id: str | None, *, max_abs: float) -> dict:
    if not session.active:
        raise ApiError(409, f"session {session.id} has ended; rewards can no longer change")
    if session.ending is not None:
        raise ApiError(409, f"session {session.id} is ending (end_session was called); rewards can no longer change")
    try:
        targets = session.set_reward(reward, interaction_id, max_abs=max_abs)
    except ValueError as exc:
        raise bad_request("reward", str(exc).split(":", 1)[-1].strip()) from exc
    except KeyError as exc:
        raise bad_request("interaction_id", str(exc.args[0]).split(":", 1)[-1].strip()) from exc
    except LookupError as exc:
        raise ApiError(409, f"session {session.id}: {exc}; set the reward after a model call") from exc
    return {"session_id": session.id, "interaction_ids": [t.id for t in targets], "reward": reward}


async def end_session(gw: Gateway, session: Session, *, reason: str = "ended", force: bool = False) -> dict:
    """Idempotent and safe under concurrency: the first call exports; calls racing it, and later ones, wait for the
    same export. 200 only once the bus has confirmed every trajectory; 503 (the session stays open, its export
    queued) when that takes longer than publish_timeout_s; 429 (the session stays active, nothing exported) while
    the outbox is full, unless `force` (shutdown); 413 when the export can never be published."""
    if session.active:
        await _exported(gw, session, reason, force)
        await _confirmed(gw, session)
    if session.refusal is not None:
        raise session.refusal
    return {"session_id": session.id, "state": session.state.value, "end_reason": session.end_reason,
            "interaction_count": session.interaction_count, "trajectories": session.exported, "published": True}


async def _exported(gw: Gateway, session: Session, reason: str, force: bool) -> None:
    """Export the session once (racing calls share it); raises, with the session as it was, when it cannot."""
    if session.ending is None:
        session.ending = asyncio.ensure_future(_export(gw, session, reason, force))
    ending = session.ending
    try:
        await asyncio.shield(ending)
    except BaseException:
        if session.ending is ending and ending.done():
            session.ending = None  # it failed before the export was queued: a later call tries again
        raise


async def _store_images(gw: Gateway, session: Session) -> None:
    """The session's images in the object store before the trajectories naming them are published (a failure
    leaves the session as it was: the agent may end it again)."""
    blobs = {hashlib.sha256(b).hexdigest(): b for i in session.interactions for b in i.images}
    if not blobs:
        return
    if gw.vision is None or gw.vision.store is None:
        raise ApiError(503, "this gateway has no image store: sessions with images cannot be exported")
    try:
        for blob in blobs.values():
            await gw.vision.store.put(blob)
    except Exception as exc:  # noqa: BLE001 - the bus's errors, whatever their type: the export is retried
        raise ApiError(503, f"storing the session's images failed ({exc}); end the session again",
                       headers={"retry-after": "5"}) from exc


async def _export(gw: Gateway, session: Session, reason: str, force: bool) -> None:
    await _drain(gw, session)
    defaulted = bool(session.interactions) and all(i.reward is None for i in session.interactions)
    if defaulted:
        session.interactions[-1].reward = 0.0
    session.end_reason = reason  # the export's metadata carries it
    trajectories = export_session(session, mode=gw.config.export_mode, gamma=gw.config.turn_discount)
    refusal = _refusal(gw, session, trajectories)
    if refusal is not None and (refusal.status == 413 or reason != "ended"):
        # it can never be published as it is (or no agent is there to fix its rewards): closed without an export
        _close(gw, session, "too_large" if refusal.status == 413 else "invalid_reward", [], refusal)
        raise refusal
    if refusal is None and not force and not gw.outbox.has_room(len(trajectories)):
        refusal = ApiError(429, f"{gw.outbox.pending} trajectories are waiting for the bus (the most the gateway "
                                f"holds is {gw.outbox.max_pending}); the session stays active: end it again later",
                           code="rate_limit_exceeded", headers={"retry-after": "5", "retry-after-ms": "5000"})
    if refusal is not None:  # the session stays as it was: the agent may fix its rewards, or retry
        session.end_reason = ""
        if defaulted:
            session.interactions[-1].reward = None
        raise refusal
    # the session ends once the bus has them all: until then it is ending (no more calls), and still holds its key,
    # its tokens and its budget slot, so a failed export is never reported as done
    await _store_images(gw, session)
    session.exports = gw.enqueue(trajectories)
    session.confirmed = asyncio.ensure_future(_settle(gw, session, trajectories))
    get_logger().info("gateway_session_exported", session_id=session.id, reason=reason,
                      trajectory_ids=[t.trajectory_id for t in trajectories])


def _refusal(gw: Gateway, session: Session, trajectories: list) -> ApiError | None:
    """Why the export must not be published (bad reward sums, a trajectory too large), or None."""
    try:
        check_rewards(trajectories, gw.config.max_abs_reward)
    except ValueError as exc:
        return bad_request("reward", str(exc).split(":", 1)[-1].strip())
    too_large = oversize(trajectories, gw.config.max_trajectory_bytes)
    return None if too_large is None else _too_large(session, too_large)


def _too_large(session: Session, why: str) -> ApiError:
    return ApiError(413, f"session {session.id} cannot be exported: {why}; the session is closed without it (start "
                         "a new, shorter episode)", code="trajectory_too_large")


async def _settle(gw: Gateway, session: Session, trajectories: list) -> None:
    """Once every export has resolved: end the session (all published), or close it with what was (one was
    refused for good). The outbox resolves every future (published, dropped, or closed at shutdown)."""
    results = await asyncio.gather(*session.exports, return_exceptions=True)
    if not session.active:
        return
    errors = [r for r in results if isinstance(r, BaseException)]
    published = [t for t, r in zip(trajectories, results, strict=True) if not isinstance(r, BaseException)]
    if not errors:
        _close(gw, session, session.end_reason, published)
    elif not any(isinstance(e, OutboxClosed) for e in errors):
        error = errors[0]
        refusal = _too_large(session, str(error)) if isinstance(error, PayloadTooLarge) else \
            ApiError(500, f"session {session.id}: the bus refused its export for good ({error}); it was closed")
        _close(gw, session, "too_large" if refusal.status == 413 else "export_refused", published, refusal)


async def _confirmed(gw: Gateway, session: Session) -> None:
    """Wait (at most publish_timeout_s) for the session's export to settle; 503 while it has not."""
    confirmed = session.confirmed
    if not confirmed.done():
        await asyncio.wait({confirmed}, timeout=gw.config.publish_timeout_s)
    if confirmed.done():
        confirmed.result()  # a bug in settling surfaces here (500), not as a silent 503
    if session.active:
        retry = gw.config.retry_after_s
        raise ApiError(503, f"session {session.id}: the bus has not confirmed its {len(session.exports)} "
                            f"trajectories within publish_timeout_s ({gw.config.publish_timeout_s:g} s); the session "
                            "stays open with its export queued: call end_session again (it waits for the same "
                            "export; nothing is exported twice)", code="export_pending",
                       headers={"retry-after": str(max(1, round(retry))), "retry-after-ms": str(int(retry * 1000))})


def _close(gw: Gateway, session: Session, reason: str, published: list, refusal: ApiError | None = None) -> None:
    """ENDED: its budget slot, tokens and replays are released; `published`: the trajectories the bus holds."""
    session.transition(SessionState.ENDED, reason)
    session.exported = len(published)
    session.refusal = refusal
    own = sum(t.group_id == session.group_id for t in published)
    gw.budget.end(session.group_id, session.group_size, exported=own > 0, extra=len(published) - own)
    gw.recorded_tokens -= session.tokens
    session.release()
    gw.replays.forget_session(session.id)
    metrics.SESSIONS.labels(reason).inc()
    metrics.TRAJECTORIES.inc(len(published))
    log = get_logger().info if refusal is None else get_logger().warning
    log("gateway_session_ended", session_id=session.id, reason=reason, interactions=session.interaction_count,
        trajectory_ids=[t.trajectory_id for t in published], refused=None if refusal is None else refusal.message)


async def _drain(gw: Gateway, session: Session) -> None:
    """Let the session's requests in flight finish (bounded), so their interactions are part of the export."""
    deadline = time.monotonic() + gw.config.publish_timeout_s
    while session.inflight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(gw.config.poll_interval_s)


async def reap(gw: Gateway, stop: asyncio.Event) -> None:
    """End sessions idle past the timeout; forget ended ones after the replay window."""
    while not stop.is_set():
        await sleep_or_stop(stop, gw.config.reap_interval_s)
        for session in gw.sessions.idle(now() - gw.config.idle_timeout_s):
            if session.inflight == 0 and session.ending is None:  # one that is ending ends when the bus confirms
                try:
                    await _exported(gw, session, "idle", force=False)
                except ApiError as exc:
                    get_logger().warning("gateway_reap_deferred", session_id=session.id, error=exc.message)
                    if exc.status == 429:  # the outbox is full: the next round tries again
                        break
        gw.sessions.prune(now() - gw.config.ended_ttl_s)


async def shutdown(gw: Gateway) -> None:
    """Export every active session (with the rewards set so far), then flush the outbox."""
    for session in gw.sessions.active:
        try:
            await _exported(gw, session, "shutdown", force=True)
        except ApiError as exc:
            if exc.status == 429:  # it shared an end that found the outbox full: export it again, forced
                with contextlib.suppress(ApiError):
                    await _exported(gw, session, "shutdown", force=True)
    await gw.outbox.close(gw.config.publish_timeout_s)
    gw.offload.close()
