"""Model routes (OpenAI and Anthropic dialects): authenticate, parse, run, render. No logic of their own."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.rollout.gateway import anthropic_api, openai_render, responses_api
from services.rollout.gateway.core import Gateway
from services.rollout.gateway.errors import ApiError, Dialect, bad_request, error_body
from services.rollout.gateway.http import SSE_HEADERS, api_key, json_response, load_json, read_body, replay_key
from services.rollout.gateway.messages import GenRequest
from services.rollout.gateway.openai_parse import parse_chat, parse_completions
from services.rollout.gateway.runs import Run
from services.rollout.gateway.scoring import is_scoring, parse_score
from services.rollout.gateway.tokens import chat_prompt


class RunStream(StreamingResponse):
    """An event stream of one run; when the response ends before the run (the client disconnected), the run is
    abandoned: its sequences are aborted in the engine and nothing is recorded."""

    def __init__(self, body: AsyncIterator[bytes], run: Run) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.abandon()  # a no-op once the run has finished


def sse(run: Run, body: AsyncIterator[bytes], dialect: Dialect = "openai") -> StreamingResponse:
    """An event stream; an error after the headers went out (the engine stopped) ends it with an error event."""
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        except ApiError as err:
            data = json.dumps(error_body(err, dialect))
            yield (f"event: error\ndata: {data}\n\n" if dialect == "anthropic" else f"data: {data}\n\n").encode()

    return RunStream(guarded(), run)


def add_model_routes(app: Starlette, gw: Gateway) -> None:
    cfg = gw.config
    started = int(time.time())

    async def parsed(request: Request, parse: Callable[[dict], GenRequest]) -> tuple[GenRequest, bytes]:
        """Read the body (bounded), then parse it: on the loop when small, on a worker thread when large."""
        raw = await read_body(request, cfg.max_body_bytes)

        def work() -> GenRequest:
            req = parse(load_json(raw, max_depth=cfg.max_json_depth))
            req.body_bytes = len(raw)
            return req

        return await gw.offload.run(len(raw), work), raw

    async def chat_completions(request: Request) -> Response:
        caller = gw.caller(api_key(request))
        req, raw = await parsed(request, lambda body: parse_chat(body, max_n=cfg.max_n, strict=cfg.reject_unknown_params,
                                                                 template_kwargs=cfg.template_kwargs))
        run = await gw.run(req, caller, replay_key(request, raw))
        if req.stream:
            return sse(run, openai_render.chat_stream(run, req.n, req.model, gw.backend.version, gw.fmt,
                                                 logprobs=req.logprobs, include_usage=req.include_usage))
        return json_response(openai_render.chat_response(await run.finish(), gw.fmt, logprobs=req.logprobs))

    async def completions(request: Request) -> Response:
        caller = gw.caller(api_key(request))
        raw = await read_body(request, cfg.max_body_bytes)
        body = await gw.offload.run(len(raw), lambda: load_json(raw, max_depth=cfg.max_json_depth))
        if is_scoring(body):  # echo: the prompt's own log-probs (a served teacher), nothing generated or recorded
            return json_response(await gw.score(parse_score(body, gw.vocab_size)))
        req = await gw.offload.run(len(raw), lambda: parse_completions(body, max_n=cfg.max_n,
                                                                       strict=cfg.reject_unknown_params))
        req.body_bytes = len(raw)
        run = await gw.run(req, caller, replay_key(request, raw))
        if req.stream:
            return sse(run, openai_render.completions_stream(run, req.model, gw.fmt, logprobs=req.logprobs,
                                                        include_usage=req.include_usage))
        return json_response(openai_render.completions_response(await run.finish(), gw.fmt, logprobs=req.logprobs))

    async def responses(request: Request) -> Response:
        caller = gw.caller(api_key(request))
        req, raw = await parsed(request, lambda body: responses_api.parse_responses(body, strict=cfg.reject_unknown_params))
        run = await gw.run(req, caller, replay_key(request, raw))
        if req.stream:
            return sse(run, responses_api.response_stream(req, run, req.model))
        c = await run.finish()
        return json_response(responses_api.response_object(req, c.id, c.created, req.model, c))

    async def messages(request: Request) -> Response:
        caller = gw.caller(api_key(request))
        req, raw = await parsed(request, lambda body: anthropic_api.parse_messages(body, strict=cfg.reject_unknown_params))
        run = await gw.run(req, caller, replay_key(request, raw))
        if req.stream:
            return sse(run, anthropic_api.message_stream(run, req.model), "anthropic")
        return json_response(anthropic_api.message_response(await run.finish()))

    async def count_tokens(request: Request) -> Response:
        """Rendering and tokenizing cost what a generation's prompt does: admitted like one (the in-flight bound),
        and always on the bounded worker threads (429 when they are backed up)."""
        caller = gw.caller(api_key(request))
        raw = await read_body(request, cfg.max_body_bytes)
        gw.check_room(None)

        def work() -> int:
            body = load_json(raw, max_depth=cfg.max_json_depth)
            req = anthropic_api.parse_messages({"max_tokens": 1, **body}, strict=cfg.reject_unknown_params)
            return len(chat_prompt(gw.fmt, req.messages, req.tools, caller.session).ids)

        gw.inflight += 1
        try:
            return json_response({"input_tokens": await gw.offload.run(len(raw), work, always=True)})
        finally:
            gw.inflight -= 1

    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize for a text prompt: how this model reads it (a served teacher's tokenizer is checked
        against the policy's this way)."""
        gw.caller(api_key(request))
        raw = await read_body(request, cfg.max_body_bytes)
        body = await gw.offload.run(len(raw), lambda: load_json(raw, max_depth=cfg.max_json_depth))
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise bad_request("prompt", "expected a string")
        ids = await gw.offload.run(len(raw), lambda: gw.fmt.encode(body["prompt"]))
        return json_response({"count": len(ids), "max_model_len": gw.max_context, "tokens": ids})

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": started, "owned_by": "meshrl"}

    async def list_models(request: Request) -> Response:
        gw.caller(api_key(request))
        return json_response({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        gw.caller(api_key(request))
        if request.path_params["model"] != cfg.model_name:
            raise ApiError(404, f"model {request.path_params['model']!r} not found; this gateway serves {cfg.model_name!r}")
        return json_response(model_card())

    for prefix in ("/v1", ""):
        app.add_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        app.add_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_route(f"{prefix}/responses", responses, methods=["POST"])
        app.add_route(f"{prefix}/messages", messages, methods=["POST"])
        app.add_route(f"{prefix}/messages/count_tokens", count_tokens, methods=["POST"])
        app.add_route(f"{prefix}/models", list_models, methods=["GET"])
        app.add_route(f"{prefix}/models/{{model:path}}", get_model, methods=["GET"])
    app.add_route("/tokenize", tokenize, methods=["POST"])
