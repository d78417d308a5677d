"""`make fuzz`: property-based fuzzing (hypothesis) of every edge that takes input from outside a service.

Targets, each in-process against the real code:
- gateway: HTTP requests (OpenAI chat / completions / responses, Anthropic messages / count_tokens, /rl/*, any path)
  to the real app (Starlette, lifespan running) over a real tiny Qwen3 in the EmbeddedEngine, through httpx's ASGI
  transport: mostly-valid bodies with mutated fields, corrupted bytes, deep nesting, oversized bodies, wrong keys,
  racing copies of one request.
- prompts (rollout), traj.raw (reward), traj.scored (builder), batches (trainer): malformed bus messages (random and
  truncated bytes, wrong / missing type headers, protos with extreme and inconsistent fields) through the same
  decode + handler + settle path `services.common.bus.consume` runs (the trainer's: `read_batch`'s decode and
  `handle_batch`'s validation). What handlers publish is recorded in memory.

Per target, one JSON line: cases, crashes (an exception other than the refusal the edge documents: a non-4xx
answer shape, an exception out of the app, a handler error other than InvalidMessage / ValueError),
server_errors_for_client_faults (5xx answers), unrelated_sequences_aborted (canary sequences generated beside the
fuzzed requests in the same engine that ended "abort" or "error"), hung (no answer within the deadline), seconds.

    python -m bench.fuzz [--cases 10000] [--seed 0] [--targets gateway,prompts,traj.raw,traj.scored,batches]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

HANG_S = 120.0
TARGETS = ("gateway", "prompts", "traj.raw", "traj.scored", "batches")
ADMIN = "fuzz-admin-key-0123456789"


# the harness ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Tally:
    target: str
    cases: int = 0
    crashes: int = 0
    server_errors_for_client_faults: int = 0
    unrelated_sequences_aborted: int = 0
    hung: int = 0
    seconds: float = 0.0
    outcomes: Counter = dataclasses.field(default_factory=Counter)
    first_failures: list = dataclasses.field(default_factory=list)

    def fail(self, kind: str, detail: str) -> None:
        if len(self.first_failures) < 5:
            self.first_failures.append(f"{kind}: {detail[:600]}")

    def line(self) -> dict:
        out = {"target": self.target, "cases": self.cases, "crashes": self.crashes,
               "server_errors_for_client_faults": self.server_errors_for_client_faults,
               "unrelated_sequences_aborted": self.unrelated_sequences_aborted, "hung": self.hung,
               "seconds": round(self.seconds, 1), "outcomes": dict(sorted(self.outcomes.items()))}
        if self.first_failures:
            out["first_failures"] = self.first_failures
        return out


class LoopThread:
    """An event loop on its own thread: the services' state lives there; hypothesis drives it from this thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable, timeout: float | None = HANG_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def drive(strategy, fn: Callable[[Any], None], cases: int, seed: int) -> None:
    """fn(example) for `cases` examples of `strategy` (generation only: nothing is shrunk, fn never raises)."""
    @settings(max_examples=cases, database=None, deadline=None, phases=[Phase.generate], print_blob=False,
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(strategy)
    def run(example) -> None:
        fn(example)

    run()


def tiny_engine(max_context: int = 256, seed: int = 0):
    import torch

    from services.rollout.engines.torch_engine import EmbeddedEngine
    from services.trainer.models.tiny_qwen3 import TinyQwen3Config, build_tokenizer, padded_vocab_size

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, max_position_embeddings=4096).build(
        padded_vocab_size(tok), eos_token_id=tok.eos_token_id)
    engine = EmbeddedEngine(model.eval(), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=32,
                            max_context=max_context, seed=seed)
    return engine, tok


class Canaries:
    """Ordinary sequences generated beside the fuzzed work in the same engine: none may end "abort" / "error"."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reasons: Counter = Counter()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        from services.rollout.engines.sequence import Sampling

        sampling = Sampling(temperature=1.0, max_new_tokens=24)
        while not self._stop.is_set():
            seqs = await self.engine.generate([5, 6, 7, 8, 9], sampling, n=2)
            self.reasons.update(s.finish_reason for s in seqs)

    async def stop(self) -> int:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 60)
        return self.reasons["abort"] + self.reasons["error"]


# JSON values ------------------------------------------------------------------------------------------------------
EDGE = [0, -1, 1, 2, 7, 10**6, 2**31, 2**63, 10**30, -(10**30), 0.0, -0.0, 1e-300, 1e300, 1e-45, 2.0000001, 0.5,
        "", "x" * 3000, "\u0000", "\U0001f600", [], {}, None, True, False, [1], {"type": "text"}]
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=12), st.sampled_from(EDGE))
junk = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
                    max_leaves=10)


def maybe(valid, weight: int = 16):
    """Mostly a valid value, sometimes anything."""
    return st.one_of(*([valid] * weight), junk)


text = st.one_of(st.text(max_size=40), st.sampled_from(["hi", "What is 2+2?", "<tool_call>", "<|im_end|>", "x" * 300]))
role = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "bot", ""])
tool_call = st.fixed_dictionaries({"id": maybe(st.text(max_size=8)), "type": maybe(st.just("function")),
                                   "function": maybe(st.fixed_dictionaries({"name": maybe(st.sampled_from(["calc", "f"])),
                                                                            "arguments": maybe(st.sampled_from(['{"x": 1}', "{", "[]", "[" * 500]))}))})
part = st.one_of(st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "input_text", "image_url", "refusal"])),
                                        "text": maybe(text)}), junk)
chat_message = st.fixed_dictionaries(
    {"role": maybe(role), "content": maybe(st.one_of(text, st.lists(part, max_size=3)))},
    optional={"tool_calls": maybe(st.lists(tool_call, max_size=2)), "tool_call_id": maybe(st.text(max_size=6)),
              "name": maybe(st.text(max_size=6))})
fn_tool = st.fixed_dictionaries({"type": maybe(st.just("function")), "function": maybe(st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["calc", "f", ""])), "parameters": maybe(st.just({"type": "object", "properties": {}}))}))})
sampling = {"temperature": maybe(st.floats(0, 2)), "top_p": maybe(st.floats(0.01, 1)), "top_k": maybe(st.integers(-1, 50)),
            "n": maybe(st.integers(1, 3)), "stop": maybe(st.lists(st.sampled_from(["\n", "a", "</tool_call>"]), max_size=3)),
            "stream": maybe(st.booleans()), "logprobs": maybe(st.booleans()), "seed": maybe(st.integers(0, 9)),
            "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()}))}
CHAT = st.fixed_dictionaries({"model": maybe(st.just("m")), "messages": maybe(st.lists(chat_message, min_size=1, max_size=4))},
                             optional={**sampling, "max_tokens": maybe(st.integers(1, 8)),
                                       "max_completion_tokens": maybe(st.integers(1, 8)),
                                       "tools": maybe(st.lists(fn_tool, max_size=2)),
                                       "tool_choice": maybe(st.sampled_from(["auto", "none", "required",
                                                                             {"type": "function", "function": {"name": "calc"}}])),
                                       "chat_template_kwargs": maybe(st.sampled_from([{"enable_thinking": False},
                                                                                      {"chat_template": "{{ 1 }}"}, {}])),
                                       "logit_bias": maybe(st.just({})), "frequency_penalty": maybe(st.just(0)),
                                       "response_format": maybe(st.just({"type": "text"}))})
COMPLETIONS = st.fixed_dictionaries({"model": maybe(st.just("m")),
                                     "prompt": maybe(st.one_of(text, st.lists(st.integers(-3, 300), min_size=1, max_size=40),
                                                               st.lists(st.integers(0, 2**40), max_size=3)))},
                                    optional={**sampling, "max_tokens": maybe(st.integers(1, 8)), "echo": junk,
                                              "best_of": junk, "suffix": junk})
item = st.one_of(chat_message, st.fixed_dictionaries({"type": maybe(st.sampled_from(["function_call", "function_call_output",
                                                                                      "reasoning", "message", "x"])),
                                                      "call_id": maybe(st.text(max_size=6)), "name": maybe(st.just("calc")),
                                                      "arguments": maybe(st.just("{}")), "output": junk}))
RESPONSES = st.fixed_dictionaries({"model": maybe(st.just("m")), "input": maybe(st.one_of(text, st.lists(item, max_size=3)))},
                                  optional={"instructions": maybe(text), "temperature": maybe(st.floats(0, 2)),
                                            "top_p": maybe(st.floats(0.01, 1)), "max_output_tokens": maybe(st.integers(1, 8)),
                                            "stream": maybe(st.booleans()), "tools": maybe(st.lists(fn_tool, max_size=2)),
                                            "previous_response_id": maybe(st.text(max_size=10)), "text": junk,
                                            "store": junk, "background": junk, "top_logprobs": junk})
block = st.one_of(st.fixed_dictionaries({"type": maybe(st.sampled_from(["text", "tool_use", "tool_result", "image",
                                                                         "thinking"])),
                                         "text": maybe(text)},
                                        optional={"id": maybe(st.text(max_size=5)), "name": maybe(st.just("calc")),
                                                  "input": maybe(st.just({"x": 1})), "tool_use_id": maybe(st.text(max_size=5)),
                                                  "content": maybe(st.one_of(text, st.lists(part, max_size=2)))}), junk)
a_message = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "system"])),
                                   "content": maybe(st.one_of(text, st.lists(block, max_size=3)))})
a_tool = st.fixed_dictionaries({"name": maybe(st.sampled_from(["calc", ""])),
                                "input_schema": maybe(st.just({"type": "object"}))}, optional={"type": junk})
MESSAGES = st.fixed_dictionaries({"model": maybe(st.just("c")), "max_tokens": maybe(st.integers(1, 8)),
                                  "messages": maybe(st.lists(a_message, min_size=1, max_size=3))},
                                 optional={"system": maybe(st.one_of(text, st.lists(part, max_size=2))),
                                           "temperature": maybe(st.floats(0, 1)), "top_p": maybe(st.floats(0.01, 1)),
                                           "top_k": maybe(st.integers(0, 50)), "stop_sequences": maybe(st.lists(text, max_size=2)),
                                           "stream": maybe(st.booleans()), "tools": maybe(st.lists(a_tool, max_size=2)),
                                           "tool_choice": maybe(st.sampled_from([{"type": "auto"}, {"type": "any"},
                                                                                 {"type": "tool", "name": "calc"}])),
                                           "thinking": junk, "metadata": junk, "container": junk})
START = st.fixed_dictionaries({"task_id": maybe(st.text(max_size=12))},
                              optional={"group_size": maybe(st.integers(1, 4)), "api_key": maybe(st.text(min_size=1, max_size=20)),
                                        "metadata": maybe(st.dictionaries(st.text(max_size=5), junk, max_size=3))})
REWARD = st.fixed_dictionaries({"reward": maybe(st.floats(-2, 2))},
                               optional={"interaction_id": maybe(st.text(max_size=10)), "session_id": maybe(st.text(max_size=10))})
END = st.one_of(st.just({}), st.fixed_dictionaries({}, optional={"session_id": junk, "extra": junk}))

ROUTES = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETIONS), ("POST", "/v1/responses", RESPONSES),
          ("POST", "/v1/messages", MESSAGES), ("POST", "/v1/messages/count_tokens", MESSAGES),
          ("POST", "/chat/completions", CHAT), ("POST", "/messages", MESSAGES),
          ("POST", "/rl/start_session", START), ("POST", "/rl/set_reward", REWARD), ("POST", "/rl/end_session", END)]
OTHER = [("GET", "/rl/status"), ("GET", "/rl/sessions/{sid}"), ("GET", "/v1/models"), ("GET", "/v1/models/meshrl-policy"),
         ("GET", "/v1/models/../../etc"), ("GET", "/health"), ("DELETE", "/v1/chat/completions"), ("GET", "/v1/messages"),
         ("POST", "/v1/nope"), ("PUT", "/rl/start_session")]


@st.composite
def raw_body(draw, body_strategy, limit: int) -> bytes:
    body = draw(body_strategy)
    body = dict(body) if isinstance(body, dict) else body  # strategies may share one object between examples
    if draw(st.integers(0, 9)) == 0:  # a field replaced by anything, or an unknown field
        key = draw(st.sampled_from(sorted(body) + ["surprise"])) if isinstance(body, dict) else None
        if key is not None:
            body[key] = draw(junk)
    try:
        raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        raw = b"{}"
    kind = draw(st.integers(0, 31))
    if kind == 0:
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif kind == 1:
        raw = draw(st.binary(max_size=64))
    elif kind == 2:
        depth = draw(st.sampled_from([65, 200, 5000, 100_000]))
        raw = b'{"model":' + b"[" * depth + b"]" * depth + b"}"
    elif kind == 3:
        raw = raw + b" " * (limit + 1 - len(raw)) if len(raw) <= limit else raw
    elif kind == 4:
        raw = raw.replace(b'"hi"', b'"\\ud800hi"').replace(b'"m"', b'"\\udfff"')
    elif kind == 5:
        raw = b"\xef\xbb\xbf" + raw if draw(st.booleans()) else raw + b"\xff"
    elif kind == 6:
        raw = json.dumps(draw(junk)).encode()
    elif kind == 7:
        raw = raw.replace(b"0.5", b"NaN").replace(b"1", b"1e999", 1)
    return raw


@dataclasses.dataclass
class Request:
    method: str
    path: str
    raw: bytes
    key: str          # "session", "admin", "ended", "none", "garbage", "other-header"
    copies: int
    idem: str | None
    retry: int


@st.composite
def gateway_request(draw, limit: int) -> Request:
    if draw(st.integers(0, 14)) == 0:
        method, path = draw(st.sampled_from(OTHER))
        raw = b""
    else:
        method, path, body = draw(st.sampled_from(ROUTES))
        raw = draw(raw_body(body, limit))
    key = draw(st.sampled_from(["session"] * 6 + ["admin", "ended", "none", "garbage", "other-header"]))
    copies = draw(st.sampled_from([1] * 8 + [2, 3]))
    idem = draw(st.one_of(st.none(), st.none(), st.text(max_size=8), st.just("k" * 300)))
    return Request(method, path, raw, key, copies, idem, draw(st.sampled_from([0, 0, 0, 1])))


def error_shape_ok(path: str, body: Any) -> bool:
    if "/messages" in path:
        return isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict) \
            and isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str)
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and \
        set(body["error"]) == {"message", "type", "param", "code"}


def fuzz_gateway(cases: int, seed: int) -> Tally:
    import httpx

    from services.rollout.gateway import GatewayConfig, create_app

    tally = Tally("gateway")
    limit = 64 * 1024
    engine, tok = tiny_engine(max_context=256)
    published: list = []

    async def publish(traj) -> None:
        published.append(traj.trajectory_id)

    config = GatewayConfig(admin_key=ADMIN, max_body_bytes=limit, max_tokens_cap=8, max_n=3, max_wait_s=2.0,
                           request_timeout_s=60.0, max_session_interactions=32, publish_timeout_s=2.0, offload_bytes=4096)
    app = create_app(config, engine, tok, publish)
    gw = app.state.gateway
    loop = LoopThread()
    state: dict[str, Any] = {}

    async def setup() -> None:
        engine.start()
        state["lifespan"] = app.router.lifespan_context(app)
        await state["lifespan"].__aenter__()
        state["client"] = httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=True),
                                            base_url="http://gateway", timeout=HANG_S)
        state["canaries"] = Canaries(engine)
        state["canaries"].start()
        state["ended"] = await fresh_session(end=True)
        state["sessions"] = [await fresh_session() for _ in range(4)]

    async def fresh_session(end: bool = False) -> dict:
        client = state["client"]
        r = await client.post("/rl/start_session", json={"task_id": "fuzz"}, headers={"Authorization": f"Bearer {ADMIN}"})
        s = r.json()
        if end:
            await client.post("/rl/end_session", headers={"Authorization": f"Bearer {s['api_key']}"})
        return s

    async def one(req: Request, session: dict) -> None:
        headers = {"content-type": "application/json"}
        token = {"session": session["api_key"], "admin": ADMIN, "ended": state["ended"]["api_key"], "none": None,
                 "garbage": "sk-\u00e9\u00e9-garbage", "other-header": session["api_key"]}[req.key]
        if token is not None and req.key != "other-header":
            headers["authorization"] = f"Bearer {token}" if req.key != "garbage" else "Bearer garbage-key"
        elif token is not None:
            headers["x-api-key"] = token
        if req.idem is not None:
            headers["idempotency-key"] = req.idem.encode("utf-8", "surrogatepass")  # any bytes may arrive
        if req.retry:
            headers["x-stainless-retry-count"] = str(req.retry)
        path = req.path.replace("{sid}", session["session_id"])
        try:
            r = await state["client"].request(req.method, path, content=req.raw or None, headers=headers)
        except Exception as exc:  # noqa: BLE001 - out of the app: a crash
            tally.crashes += 1
            tally.fail("crash", f"{req.method} {path} {req.raw[:200]!r}: {type(exc).__name__}: {exc}")
            return
        tally.outcomes[str(r.status_code)] += 1
        if r.status_code >= 500:
            tally.server_errors_for_client_faults += 1
            tally.fail("5xx", f"{req.method} {path} {req.raw[:300]!r} -> {r.status_code} {r.text[:300]}")
        elif r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = None
            if not error_shape_ok(path, body):
                tally.crashes += 1
                tally.fail("shape", f"{req.method} {path} -> {r.status_code} {r.text[:300]}")

    async def case(req: Request, n: int) -> None:
        if n % 8 == 0:  # sessions fill up and end under the fuzz: keep fresh ones around
            state["sessions"] = state["sessions"][1:] + [await fresh_session()]
        session = state["sessions"][n % len(state["sessions"])]
        await asyncio.gather(*(one(req, session) for _ in range(req.copies)))

    def run(req: Request) -> None:
        tally.cases += 1
        try:
            loop.run(case(req, tally.cases), HANG_S)
        except TimeoutError:
            tally.hung += 1
            tally.fail("hung", f"{req.method} {req.path} {req.raw[:200]!r}")

    started = time.monotonic()
    loop.run(setup())
    try:
        drive(gateway_request(limit), run, cases, seed)
    finally:
        async def teardown() -> None:
            tally.unrelated_sequences_aborted = await state["canaries"].stop()
            await state["client"].aclose()
            await state["lifespan"].__aexit__(None, None, None)

        loop.run(teardown())
        engine.stop()
        loop.close()
    tally.seconds = time.monotonic() - started
    tally.outcomes["engine_steps_failed"] = engine.stats.steps_failed
    tally.outcomes["published"] = len(published)
    tally.outcomes["offloaded"] = gw.offload.offloaded
    return tally


# bus messages -----------------------------------------------------------------------------------------------------
i32 = st.one_of(st.integers(-3, 300), st.integers(-(2**31), 2**31 - 1))
i64 = st.integers(-(2**63), 2**63 - 1)
f32 = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                st.sampled_from([0.0, 1e-38, 1e-45, float("nan"), float("inf"), -float("inf"), -1.0, 11.0, 1e30]))
valid_id = st.from_regex(r"[a-z0-9][a-z0-9.:-]{0,15}", fullmatch=True)
bad_id = st.one_of(st.text(max_size=12), st.sampled_from(["", "a b", "x\r\nNats-Msg-Id: y", "k" * 300, "\u00e9"]))
token = st.integers(0, 263)
TASK = st.fixed_dictionaries({"answer": st.sampled_from(["42", "1/2", "\\frac{1}{2}", "7"]),
                              "extract": st.sampled_from(["last_number", "tag", "all"])},
                             optional={"verifier": st.sampled_from(["math", "exact"])})


def _packb(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (ValueError, TypeError, OverflowError):
        return b"\xc1"


bad_map = st.one_of(st.binary(max_size=24), junk.map(_packb), st.sampled_from([b"\xc1", b"\x91\x01", b"\x81\x01\x02"]))
bad_grading = {"grading.answer": st.text(max_size=8), "grading.extract": st.text(max_size=8),
               "grading.verifier": st.text(max_size=12), "grading.verifier_options": bad_map, "grading.rg_entry": bad_map,
               "grading.row": bad_map, "grading.extra": bad_map, "grading.eval_round": i64}


def _grading(task: dict):
    from services.common import grading

    return grading.to_proto(task)


@st.composite
def corrupt(draw, message, bad: dict):
    """A valid message with 0 (often), 1 or 2 of its fields set to what that field must refuse."""
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        field = draw(st.sampled_from(sorted(bad)))
        value = draw(bad[field])
        target = message
        for part in field.split(".")[:-1]:
            target = getattr(target, part)
        name = field.split(".")[-1]
        try:
            if isinstance(value, list):
                del getattr(target, name)[:]
                getattr(target, name).extend(value)
            else:
                setattr(target, name, value)
        except (TypeError, ValueError):
            pass
    return message


@st.composite
def prompt_work(draw):
    from services.common.contracts import data_pb2

    work = data_pb2.PromptWork(
        work_id=draw(valid_id), task_id=draw(valid_id), group_id=draw(valid_id),
        prompt_ids=draw(st.lists(token, min_size=1, max_size=20)), group_size=draw(st.integers(1, 3)),
        sampling=data_pb2.SamplingParams(temperature=draw(st.floats(0, 2, width=32)), top_p=draw(st.floats(0.0625, 1, width=32)),
                                         top_k=draw(st.integers(0, 8)), max_new_tokens=draw(st.integers(1, 8)),
                                         stop_token_ids=draw(st.lists(token, max_size=2))),
        issued_version=draw(st.integers(0, 3)), issued_at=1.0, grading=_grading(draw(TASK)),
        split=draw(st.sampled_from(["train", "eval"])))
    return draw(corrupt(work, {
        "work_id": bad_id, "group_id": bad_id, "task_id": st.text(min_size=1025, max_size=1100),
        "prompt_ids": st.one_of(st.lists(i32, max_size=300), st.just([]), st.just([5] * 256), st.just([264])),
        # sizes past the refusal bounds are refused; small valid ones keep the generation short
        "group_size": st.one_of(st.integers(-(2**31), 0), st.integers(1025, 2**31 - 1), st.integers(1, 4)),
        "sampling.temperature": f32, "sampling.top_p": f32, "sampling.top_k": i32,
        "sampling.max_new_tokens": st.one_of(st.integers(-(2**31), 0), st.integers(257, 2**31 - 1)), "sampling.stop_token_ids": st.lists(i32, min_size=1, max_size=80),
        "issued_version": i64, "issued_at": st.floats(), **bad_grading, "split": st.text(max_size=6)}))


TRAJ_BAD = {"trajectory_id": bad_id, "group_id": bad_id, "group_size": i32, "prompt_ids": st.lists(i32, max_size=20),
            "completion_ids": st.lists(i32, max_size=20), "behavior_logprobs": st.lists(f32, max_size=20),
            "versions": st.lists(i64, max_size=20), "loss_mask": st.lists(i32, max_size=20), "reward": f32,
            **bad_grading, "split": st.sampled_from(["eval", "x", ""]), "source": st.text(max_size=8),
            "finish_reason": st.text(max_size=8)}


@st.composite
def valid_trajectory(draw, group: str | None = None):
    from services.common.contracts import data_pb2

    n = draw(st.integers(0, 10))
    return data_pb2.Trajectory(
        trajectory_id=draw(valid_id), group_id=group or draw(st.sampled_from(["g-1", "g-2", "g-3"])), task_id="t",
        work_id="w", group_size=2, prompt_ids=draw(st.lists(token, min_size=1, max_size=12)),
        completion_ids=draw(st.lists(token, min_size=n, max_size=n)),
        behavior_logprobs=draw(st.lists(st.floats(-5, 0, width=32), min_size=n, max_size=n)),
        versions=draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), loss_mask=[1] * n,
        reward=draw(st.floats(0, 1, width=32)), finish_reason="stop", source="workflow", grading=_grading(draw(TASK)),
        split="train")


@st.composite
def trajectory(draw):
    return draw(corrupt(draw(valid_trajectory()), TRAJ_BAD))


@st.composite
def trajectory_group(draw):
    """A group message (traj.raw / traj.scored): members of one group, some corrupt; or members of two groups, a
    member twice, a group id that is not theirs, no members at all."""
    from services.common.contracts import data_pb2

    members = [draw(trajectory()) if draw(st.booleans()) else draw(valid_trajectory())
               for _ in range(draw(st.integers(1, 4)))]
    group_id = members[0].group_id
    if draw(st.booleans()):
        for m in members:
            m.group_id = group_id
    if draw(st.integers(0, 7)) == 0:
        members.append(members[0])
    message = data_pb2.TrajectoryGroup(group_id=group_id, trajectories=members)
    return draw(corrupt(message, {"group_id": bad_id, "trajectories": st.just([])}))


@st.composite
def trajectory_bundle(draw):
    """A rollout's bundle (traj.raw): group messages as above, or one group twice, or none."""
    from services.common.contracts import data_pb2

    groups = [draw(trajectory_group()) for _ in range(draw(st.integers(1, 3)))]
    if draw(st.integers(0, 7)) == 0:
        groups.append(groups[0])
    return draw(corrupt(data_pb2.TrajectoryBundle(groups=groups), {"groups": st.just([])}))


@st.composite
def training_batch(draw):
    from services.common.contracts import data_pb2

    batch = data_pb2.TrainingBatch(batch_id="batch-0", index=0, dropped_stale=0,
                                   trajectories=[draw(corrupt(draw(valid_trajectory()), TRAJ_BAD)) if draw(st.booleans())
                                                 else draw(valid_trajectory()) for _ in range(draw(st.integers(1, 4)))])
    return draw(corrupt(batch, {"index": i64, "trajectories": st.just([]), "batch_id": bad_id,
                                "group_ids": st.lists(bad_id, max_size=3)}))


@st.composite
def bus_message(draw, proto, type_name: str):
    message = draw(proto)
    data = message.SerializeToString()
    header = type_name
    kind = draw(st.integers(0, 11))
    if kind == 0:
        data = draw(st.binary(max_size=80))
    elif kind == 1:
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif kind == 2 and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:]
    elif kind == 3:
        data = data + draw(proto).SerializeToString()  # a merge of two messages
    elif kind == 4:
        header = draw(st.sampled_from(["meshrl.v1.Trajectory", "meshrl.v1.TrajectoryGroup",
                                       "meshrl.v1.TrajectoryBundle", "meshrl.v1.PromptWork", "", "x"]))
    elif kind == 5:
        header = None
    return data, header


class FuzzMsg:
    """What a consumer handler sees of a NATS message: subject, data, headers, and the settle calls."""

    def __init__(self, subject: str, data: bytes, header: str | None) -> None:
        from services.common.bus import TYPE_HEADER

        self.subject, self.data = subject, data
        self.headers = {TYPE_HEADER: header} if header is not None else None
        self.metadata = None
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def ack_sync(self, timeout: float | None = None) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")

    async def term(self) -> None:
        self.settled.append("term")

    async def in_progress(self) -> None:
        pass


class RecordingBus:
    """The handlers' outputs, recorded (publishes and the builder's ledger writes); inputs are what is fuzzed."""

    ack_wait = None
    replicas = 1
    max_payload = 1 << 20

    def __init__(self) -> None:
        self.published: Counter = Counter()
        self.kv: dict[str, bytes] = {}

    async def publish(self, subject: str, message, msg_id: str, **_: Any) -> bool:
        assert msg_id and "\n" not in msg_id and "\r" not in msg_id, f"unsafe Nats-Msg-Id {msg_id!r}"
        self.published[subject.split(".")[0]] += 1
        return True

    async def put(self, key: str, value: bytes) -> int:  # the ledger's key-value bucket
        self.kv[key] = value
        return len(self.kv)

    def stream_max_bytes(self, spec) -> int:
        return -1  # no byte caps: the builder's TRAJ capacity check has nothing to refuse


async def settle(decode: Callable, handle: Callable, msg: FuzzMsg, *, manual_ack: bool = False) -> str:
    """What consume() does with one message: ok (acked or held), dead_letter (InvalidMessage), or the error."""
    from services.common.bus import InvalidMessage

    try:
        obj = decode(msg)
        if manual_ack:
            await handle(obj, msg)
        else:
            await handle(obj)
        return "ok"
    except InvalidMessage:
        return "dead_letter"


def fuzz_bus(target: str, cases: int, seed: int) -> Tally:
    from services.common import trajectory_groups
    from services.common.bus import decoder
    from services.common.contracts import data_pb2

    tally = Tally(target)
    loop = LoopThread()
    bus = RecordingBus()
    engine = canaries = None
    closers: list[Callable[[], None]] = []

    if target == "prompts":
        from services.rollout.config import RolloutConfig
        from services.rollout.server import Rollout

        engine, _ = tiny_engine(max_context=256, seed=seed)
        engine.start()
        closers.append(engine.stop)
        rollout = Rollout(RolloutConfig(), engine, bus)
        decode, handle, manual = decoder(data_pb2.PromptWork), rollout.handle_work, False
        strategy = bus_message(prompt_work(), "meshrl.v1.PromptWork")
        subject = "prompts.work"
    elif target == "traj.raw":
        from services.reward.scoring import Scorer
        from services.reward.verifiers.pool import VerifierPool
        from services.trainer.models.tiny_qwen3 import build_tokenizer, padded_vocab_size

        tok = build_tokenizer()
        pool = VerifierPool(workers=2)
        closers.append(pool.close)
        scorer = Scorer(lambda ids: tok.decode(ids, skip_special_tokens=True), "math", timeout_s=10.0,
                        vocab_size=padded_vocab_size(tok), pool=pool)

        from services.reward.server import score_groups

        async def handle(groups) -> None:  # the reward service's handler: score the groups, publish each scored
            await score_groups(scorer, bus, groups)

        decode, manual = trajectory_groups.decode_groups, False
        strategy = st.one_of(bus_message(trajectory(), "meshrl.v1.Trajectory"),
                             bus_message(trajectory_group(), "meshrl.v1.TrajectoryGroup"),
                             bus_message(trajectory_bundle(), "meshrl.v1.TrajectoryBundle"))
        subject = "traj.raw"
    elif target == "traj.scored":
        from services.builder.config import BuilderConfig
        from services.builder.server import Builder
        from services.trainer.models.tiny_qwen3 import build_tokenizer

        tok = build_tokenizer()
        builder = Builder(BuilderConfig(batch_size=2, group_size=2, eval_size=4, train_size=8), bus,
                          lambda task: tok.encode(task.prompt, add_special_tokens=False), [tok.eos_token_id])
        builder.ledger.kv = bus
        builder.budget.in_flight = 10**9  # a builder in a run: workflow groups g-* were issued (its budget asserts so)
        builder.live.set()
        decode, handle, manual = trajectory_groups.decode_groups, builder.handle_message, True
        strategy = st.one_of(bus_message(trajectory(), "meshrl.v1.Trajectory"),
                             bus_message(trajectory_group(), "meshrl.v1.TrajectoryGroup"),
                             bus_message(trajectory_bundle(), "meshrl.v1.TrajectoryBundle"))
        subject = "traj.scored"
    elif target == "batches":
        import torch

        from services.common.batches import _decode
        from services.trainer.batching import distinct_versions, pack, trajectory_staleness
        from services.trainer.engine import TrainerEngine

        engine_stub = types.SimpleNamespace(model=torch.nn.Module())
        engine_stub.model.get_input_embeddings = lambda: torch.nn.Embedding(264, 1)

        def decode(msg):  # read_batch: the stored bytes as a TrainingBatch, its index checked
            from services.common.bus import InvalidMessage

            batch = _decode(msg.data, "batch 0")
            if batch.index != 0:
                raise InvalidMessage(f"index: batch under batches.train.0 says {batch.index}")
            return batch

        async def handle(batch) -> None:  # handle_batch up to the optimizer step (ValueError: skipped, dead-lettered)
            from services.common.bus import InvalidMessage

            try:
                packed = pack(list(batch.trajectories), 0)
                TrainerEngine.check_token_ids(engine_stub, packed)
            except ValueError as exc:
                raise InvalidMessage(str(exc)) from exc
            staleness = [trajectory_staleness(t, 0) for t in batch.trajectories]
            max(0, *staleness, *(distinct_versions(t) for t in batch.trajectories))

        manual = False
        strategy = bus_message(training_batch(), "meshrl.v1.TrainingBatch")
        subject = "batches.train.0"
    else:
        raise ValueError(f"target: unknown {target!r} (known: {', '.join(TARGETS)})")

    if engine is not None:
        canaries = Canaries(engine)
        loop.run(_start(canaries))

    def run(example) -> None:
        data, header = example
        tally.cases += 1
        msg = FuzzMsg(subject, data, header)
        try:
            tally.outcomes[loop.run(settle(decode, handle, msg, manual_ack=manual), HANG_S)] += 1
        except TimeoutError:
            tally.hung += 1
            tally.fail("hung", f"{data[:200]!r}")
        except Exception as exc:  # noqa: BLE001 - consume() would nak it and retry: an error that is no refusal
            tally.crashes += 1
            tally.outcomes["error:" + type(exc).__name__] += 1
            tally.fail("crash", f"{type(exc).__name__}: {exc} <- {data[:200]!r}")

    started = time.monotonic()
    try:
        drive(strategy, run, cases, seed)
    finally:
        if canaries is not None:
            tally.unrelated_sequences_aborted = loop.run(canaries.stop())
        for close in closers:
            close()
        loop.close()
    tally.seconds = time.monotonic() - started
    tally.outcomes.update({f"published:{k}": v for k, v in bus.published.items()})
    return tally


async def _start(canaries: Canaries) -> None:
    canaries.start()


def run_target(target: str, cases: int, seed: int) -> Tally:
    return fuzz_gateway(cases, seed) if target == "gateway" else fuzz_bus(target, cases, seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10_000, help="generated inputs per target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--targets", default=",".join(TARGETS))
    args = p.parse_args(argv)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))  # the fuzz is noisy
    failed = False
    for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
        tally = run_target(target, args.cases, args.seed)
        print(json.dumps(tally.line()), flush=True)
        failed |= bool(tally.crashes or tally.server_errors_for_client_faults or tally.unrelated_sequences_aborted
                       or tally.hung)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
