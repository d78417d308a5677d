"""The gateway's state and its one generation path; the HTTP layer only parses, calls these, and renders."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import time
import uuid
from typing import Any

from services.common.contracts import data_pb2
from services.common.errors import FieldError, field_error
from services.common.ids import now
from services.common.logging import get_logger
from services.rollout.engines.sequence import Images, Sampling
from services.rollout.gateway import metrics
from services.rollout.gateway.backend import EngineBackend, Sampled
from services.rollout.gateway.budget import GroupBudget
from services.rollout.gateway.chat_format import ChatFormat
from services.rollout.gateway.config import GatewayConfig
from services.rollout.gateway.dedupe import IdempotencyCache, ReplayCache
from services.rollout.gateway.errors import ApiError, bad_request, unsupported
from services.rollout.gateway.images import Vision
from services.rollout.gateway.messages import GenRequest
from services.rollout.gateway.offload import Offload
from services.rollout.gateway.outbox import Outbox, Publish
from services.rollout.gateway.outputs import ChoiceDecoder
from services.rollout.gateway.runs import Completion, LiveRun, ReplayRun, Run
from services.rollout.gateway.scoring import ScoreRequest, score_response
from services.rollout.gateway.session import Interaction, Session, SessionStore, transcript_key
from services.rollout.gateway.tokens import Prompt, chat_prompt, completion_prompt
from services.rollout.gateway.toolcalls import forced_prefix

ID_PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_", "messages": "msg_"}
CALL_PREFIX = {"messages": "toolu_", "responses": "call_"}


@dataclasses.dataclass(frozen=True)
class Caller:
    session: Session | None   # None: the admin key (served, not recorded)


@dataclasses.dataclass(frozen=True)
class ReplayKey:
    key: str          # body digest, or "idem:<Idempotency-Key>"
    is_retry: bool    # x-stainless-retry-count > 0, or an Idempotency-Key (always looked up)


class Gateway:
    def __init__(self, config: GatewayConfig, engine: Any, tokenizer: Any, publish: Publish,
                 budget: GroupBudget | None = None, reward: Any = None, vision: Vision | None = None) -> None:
        self.config = config
        self.reward = reward       # the reward service's client (run_code, graded sessions' verifiers), or None
        self.code_runs = 0
        self.fmt = ChatFormat(tokenizer, config.extra_stop_tokens)
        self.fmt.vision = self.vision = vision  # a vision-language policy: messages may hold images
        self.budget = budget if budget is not None else GroupBudget()
        metrics.CAPACITY.set_function(lambda b=self.budget: _gauge(b.capacity()))
        self.backend = EngineBackend(engine, budget=self.budget, max_wait_s=config.max_wait_s,
                                     poll_s=config.poll_interval_s, retry_after_s=config.retry_after_s)
        self.max_context = config.max_context or self.backend.max_context or \
            min(int(getattr(tokenizer, "model_max_length", 4096)), 32768)
        self.vocab_size: int | None = getattr(engine, "vocab_size", None) or len(tokenizer)
        self.sessions = SessionStore(config.max_sessions)
        self.replays = ReplayCache(config.replay_ttl_s, config.replay_max_entries)
        self.idempotency = IdempotencyCache(config.idempotency_ttl_s, config.idempotency_max_entries)
        self.outbox = Outbox(publish, max_pending=config.max_pending_publish, linger_s=config.publish_linger_s)
        self.offload = Offload(workers=config.heavy_concurrency, queue=config.heavy_queue,
                               threshold=config.offload_bytes, retry_after_s=config.retry_after_s)
        self.recorded_tokens = 0   # prompt + completion ids held by active sessions' interactions
        self.inflight = 0
        self.requests = 0
        self.replayed = 0
        self.rejected_busy = 0

    # identity ------------------------------------------------------------------------------------------
    def is_admin(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(token.encode(), self.config.admin_key.encode())

    def caller(self, token: str | None) -> Caller:
        """Model routes: a live session's key, or the admin key (not recorded)."""
        if not token:
            raise ApiError(401, "missing API key: send the session key as 'Authorization: Bearer <key>' or 'x-api-key'")
        if self.is_admin(token):
            if not self.config.allow_admin_requests:
                raise ApiError(403, "the admin key cannot call model routes; start a session with /rl/start_session")
            return Caller(None)
        session = self.sessions.by_key(token)
        if session is None:
            raise ApiError(401, "unknown API key: no session on this gateway has it (sessions do not survive a "
                                "gateway restart); start a new episode with POST /rl/start_session")
        if not session.active:
            raise ApiError(409, f"session {session.id} has ended ({session.end_reason}); start a new one with /rl/start_session")
        if session.ending is not None:
            raise ApiError(409, f"session {session.id} is ending; start a new one with /rl/start_session")
        session.last_active = now()  # a request arrived: not idle (the reaper must not end it under this call)
        return Caller(session)

    def check_room(self, session: Session | None, n: int = 1) -> None:
        """429 when the gateway or the session cannot take another call (every queue and record is bounded)."""
        cfg = self.config
        if self.inflight >= cfg.max_inflight:
            raise _busy(f"{self.inflight} requests are in flight; the gateway serves at most {cfg.max_inflight} at once")
        if session is None:
            return
        if len(session.interactions) + n > cfg.max_session_interactions:
            raise _busy(f"session {session.id} has recorded {len(session.interactions)} calls, the most one session "
                        f"holds is {cfg.max_session_interactions}; end it and start a new one", retry=False)
        if session.tokens >= cfg.max_session_tokens:
            raise _busy(f"session {session.id} has recorded {session.tokens} tokens, the most one session holds is "
                        f"{cfg.max_session_tokens}; end it and start a new one", retry=False)
        if self.recorded_tokens >= cfg.max_recorded_tokens:
            raise _busy(f"active sessions hold {self.recorded_tokens} recorded tokens, the gateway's limit; "
                        "retry once sessions have ended")

    # generation -----------------------------------------------------------------------------------------
    async def run(self, req: GenRequest, caller: Caller, replay: ReplayKey | None = None) -> Run:
        """Admit, build the prompt, submit. Raises ApiError before anything streams; records on completion."""
        session = caller.session
        self.requests += 1
        self.check_room(session, req.n)
        token = None
        if session is not None and replay is not None:
            first = self.replays.lookup(session.id, replay.key) if replay.is_retry else None
            if first is not None and (done := await first) is not None:
                self.replayed += 1
                return ReplayRun(done)
            token = self.replays.register(session.id, replay.key)
        self.inflight += 1
        if session is not None:
            session.inflight += 1
        try:
            await self._admit(session)
            prompt = await self.offload.run(req.body_bytes, lambda: self._prompt(req, session))
            sampling = self._sampling(req, len(prompt.ids))
            self._check_engine(prompt.ids, sampling, req.n, prompt.engine_images)
            return self._launch(req, session, prompt, sampling, replay, token)
        except BaseException as exc:
            self._done(session, replay, token)
            metrics.REQUESTS.labels(req.api, str(exc.status) if isinstance(exc, ApiError) else "error").inc()
            raise

    async def score(self, req: ScoreRequest) -> dict:
        """Each prompt's token log-probs under the served weights (echo scoring); bounded like a generation."""
        scorer = getattr(self.backend.engine, "score", None)
        if scorer is None:
            raise unsupported("echo", f"the {getattr(self.backend.engine, 'kind', 'server')} engine cannot score prompts")
        for i, ids in enumerate(req.prompts):
            if len(ids) > self.max_context:
                raise bad_request(f"prompt[{i}]", f"{len(ids)} tokens; the model's context holds {self.max_context}")
        self.check_room(None)
        self.inflight += 1
        try:
            scored = await asyncio.wait_for(scorer(req.prompts, req.temperature, req.top),
                                            self.config.request_timeout_s)
        except TimeoutError as exc:
            raise ApiError(504, f"scoring took longer than {self.config.request_timeout_s:g} s") from exc
        except RuntimeError as exc:
            raise ApiError(503, f"the engine is not accepting work: {exc}") from exc
        finally:
            self.inflight -= 1
        metrics.PROMPT_TOKENS.inc(sum(len(p) for p in req.prompts))
        return score_response(req, scored, int(time.time()), ID_PREFIX["completions"] + uuid.uuid4().hex[:24],
                              self.fmt.token_text)

    async def _admit(self, session: Session | None) -> None:
        try:
            if session is None:  # the admin key: not recorded, so outside the budget
                await self.backend.admit()
            else:
                await self.backend.admit(session.group_id, session.group_size)
        except ApiError:
            self.rejected_busy += 1
            raise

    def _launch(self, req: GenRequest, session: Session | None, prompt: Prompt, sampling: Sampling,
                replay: ReplayKey | None, token) -> LiveRun:
        completion_id = ID_PREFIX[req.api] + uuid.uuid4().hex[:24]
        call_prefix = CALL_PREFIX.get(req.api, "call_")
        decoders = [ChoiceDecoder(i, self.fmt.decode, stop=req.stop, parse_tools=req.parses_tools,
                                  prefix_text=prompt.forced_text, new_call_id=lambda: call_prefix + uuid.uuid4().hex[:24])
                    for i in range(req.n)]
        version = self.backend.version
        created = int(time.time())  # one timestamp: a stream's first chunk and a later replay must agree

        def submit() -> list[Sampled]:
            try:
                return self.backend.submit(prompt.ids, sampling, req.n, prompt.engine_images)
            except RuntimeError as exc:
                raise ApiError(503, f"the engine is not accepting work: {exc}") from exc

        def finalize(pairs: list[tuple[Sampled, ChoiceDecoder]]) -> Completion:
            choices = [d.result(*_lists(s), engine_finish=_finish_reason(s), stop_token_ids=self.fmt.stop_token_ids)
                       for s, d in pairs]
            completion = Completion(id=completion_id, created=created, model=req.model or self.config.model_name,
                                    prompt=prompt, choices=choices, version=version)
            self._record(req, session, completion)
            metrics.REQUESTS.labels(req.api, "ok").inc()
            metrics.PROMPT_TOKENS.inc(len(prompt.ids))
            metrics.REUSED_TOKENS.inc(prompt.reused)
            if token is not None:
                self.replays.resolve(session.id, replay.key, token, completion)
            return completion

        return LiveRun(completion_id, created, prompt, submit, decoders, stream=req.stream,
                       poll_s=self.config.stream_interval_s, timeout_s=self.config.request_timeout_s,
                       finalize=finalize, on_exit=lambda: self._done(session, replay, token))

    def _check_engine(self, ids: list[int], sampling: Sampling, n: int, images: Images | None = None) -> None:
        """What the engine would refuse, refused here as a 400 before anything is submitted."""
        check = getattr(self.backend.engine, "check", None)
        if check is None:
            return
        try:
            check(ids, sampling, n, *([images] if images is not None else []))
        except ValueError as exc:
            found = field_error(exc) or FieldError("prompt", str(exc))
            field = {"prompt_ids": "prompt", "max_new_tokens": "max_tokens"}.get(found.field, found.field)
            raise bad_request(field, found.problem) from exc

    def _done(self, session: Session | None, replay: ReplayKey | None, token) -> None:
        self.inflight -= 1
        if session is not None:
            session.inflight -= 1
        if token is not None and not token.done():
            self.replays.fail(session.id, replay.key, token)

    def _continue_response(self, req: GenRequest, session: Session | None) -> list:
        prev = session.by_response(req.previous_response_id) if session else []
        if not prev or prev[0].messages is None:
            raise bad_request("previous_response_id", f"{req.previous_response_id!r} is not a response of this session")
        return [*prev[0].messages, prev[0].response, *req.messages]

    def _prompt(self, req: GenRequest, session: Session | None) -> Prompt:
        if req.previous_response_id:
            req.messages = self._continue_response(req, session)
        if req.api == "completions":
            if isinstance(req.prompt, list) and self.vocab_size is not None and max(req.prompt) >= self.vocab_size:
                raise bad_request("prompt", f"token id {max(req.prompt)} is outside the vocabulary [0, {self.vocab_size})")
            prompt = completion_prompt(self.fmt, req.prompt, session)
            field = "prompt"
        else:
            forced = forced_prefix(req.tool_choice) if req.tools else ""
            prompt = chat_prompt(self.fmt, req.messages, req.tools, session, forced, req.template_kwargs)
            field = {"responses": "input"}.get(req.api, "messages")
        if len(prompt.ids) >= self.max_context:
            raise bad_request(field, f"the prompt is {len(prompt.ids)} tokens; the model's context holds {self.max_context}")
        if prompt.images:
            if self.vision is None:
                raise unsupported(field, "holds images, and the policy is text-only (a vision-language model takes them)")
            try:
                pixels = self.vision.pixels(list(prompt.images))
            except ValueError as exc:
                raise bad_request(field, str(exc)) from exc
            prompt.engine_images = Images(key=tuple(hashlib.sha256(b).hexdigest() for b in prompt.images),
                                          pixel_values=pixels)
        return prompt

    def _sampling(self, req: GenRequest, prompt_len: int) -> Sampling:
        room = self.max_context - prompt_len
        wanted = min(req.max_tokens or self.config.default_max_tokens or room, self.config.max_tokens_cap or room)
        try:
            return Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            max_new_tokens=max(1, min(wanted, room)), stop_token_ids=tuple(sorted(self.fmt.stop_token_ids)))
        except ValueError as exc:
            field = str(exc).split(":")[0]
            raise bad_request({"max_new_tokens": "max_tokens"}.get(field, field), str(exc).split(":", 1)[-1].strip()) from exc

    def _record(self, req: GenRequest, session: Session | None, completion: Completion) -> None:
        if session is None:
            return
        if not session.active:
            get_logger().warning("gateway_interaction_after_end", session_id=session.id, interaction_id=completion.id)
            return
        prompt, chat = completion.prompt, req.messages is not None
        before = session.tokens
        for choice in completion.choices:
            response = choice.message() if chat else None
            session.add(Interaction(
                id=completion.id if choice.index == 0 else f"{completion.id}-{choice.index}", response_id=completion.id,
                api=req.api, parent_id=prompt.parent.id if prompt.parent else None, prompt_ids=list(prompt.ids),
                output_ids=choice.output_ids, logprobs=choice.logprobs, versions=choice.versions,
                finish_reason=choice.finish_reason, ended_on_stop_token=choice.ended_on_stop_token,
                render_text=prompt.render_text, output_text=choice.content if not chat else "", images=prompt.images,
                messages=tuple(req.messages) if chat else None, response=response,
                transcript_key=transcript_key(tuple(req.messages), response, req.tools) if chat else None,
                sampling={"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                          "reused_prompt_tokens": prompt.reused}))
        self.recorded_tokens += session.tokens - before

    # export -----------------------------------------------------------------------------------------------
    def enqueue(self, trajectories: list[data_pb2.Trajectory]):
        return self.outbox.put(trajectories)


def _busy(message: str, *, retry: bool = True) -> ApiError:
    headers = {"retry-after": "1", "retry-after-ms": "1000"}
    if not retry:
        headers["x-should-retry"] = "false"  # the session is full: only a new session helps
    return ApiError(429, message, code="rate_limit_exceeded", headers=headers)


def _gauge(capacity: int | None) -> float:
    return -1.0 if capacity is None else float(max(capacity, 0))


def _lists(s: Sampled) -> tuple[list[int], list[float], list[int]]:
    """ids / log-probs / versions; a sequence a stop string ended early may still be in the engine (aborted, not
    yet finished, or an engine without abort), so align its lists."""
    seq = s.result() if s.done else s.running
    n = len(seq.output_ids)
    while len(seq.logprobs) < n or len(seq.versions) < n:
        time.sleep(0)  # the engine thread is between its appends of one token
    return list(seq.output_ids[:n]), list(seq.logprobs[:n]), list(seq.versions[:n])


def _finish_reason(s: Sampled) -> str:
    if s.cut or not s.done:
        return ""  # ended early by a stop string (the gateway aborted it, or it is still running)
    reason = s.result().finish_reason
    if reason == "abort":
        raise ApiError(503, "the engine stopped before the generation finished")
    if reason == "error":
        raise ApiError(500, "the model failed on this request (its other requests were not affected)")
    return reason
