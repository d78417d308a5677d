"""`make bench-gateway`: the agent gateway's cost, one JSON line per case.

Set up as the rollout service runs it: one process holds the engine and serves the gateway with uvicorn on its
event loop; the agent is another process (httpx, keep-alive) on loopback. Measured side by side in one run:

- added latency: the same prompt and sampling through `engine.generate` called on the service's loop, and through
  `POST /v1/chat/completions` with a session key from the agent process, in alternating blocks; p50 / p99 of each
  and their difference, end to end (`added_*`) and inside the server (`server_added_p50_ms`: from the request's
  arrival to its last byte, minus the direct call). First with a stub engine that answers at once (the gateway's
  own path and the HTTP hop), then with a tiny Qwen3 built here (a first turn, the same streamed, a 6th turn).
- requests/s with 64 concurrent sessions (each a 4-turn conversation in one agent process): against the stub
  engine (the gateway's own capacity), and against the tiny Qwen3 beside the same agents calling the engine
  directly in-process and beside every turn's 64 prompts submitted at once (the engine's best case).

    python -m bench.gateway [--requests 200] [--sessions 64] [--turns 4] [--max-new 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

# the service side's imports (torch, transformers, the gateway) are inside its functions: the agent process
# stays light, like a real agent

ADMIN = "bench-admin-key"
QUESTION = "What is 12 + 30? Answer briefly."


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def line(**fields) -> None:
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()}), flush=True)


def history(turns: int) -> list[dict]:
    messages = [{"role": "user", "content": QUESTION}]
    for i in range(turns - 1):
        messages += [{"role": "assistant", "content": f"Step {i}: 42."}, {"role": "user", "content": "And then?"}]
    return messages


# the agent process ----------------------------------------------------------------------------------------------
async def agent_latency(url: str, body: dict, n: int, warmup: int) -> list[float]:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(url + "/rl/start_session", json={"task_id": "bench"}, headers={"Authorization": f"Bearer {ADMIN}"})
        headers = {"Authorization": f"Bearer {r.json()['api_key']}"}
        out = []
        for i in range(n + warmup):
            t0 = time.perf_counter()
            if body.get("stream"):
                async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                    async for _ in r.aiter_bytes():
                        pass
            else:
                (await client.post(url + "/v1/chat/completions", json=body, headers=headers)).raise_for_status()
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
        return out


async def agent_throughput(url: str, sessions: int, turns: int, max_new: int) -> dict:
    limits = httpx.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        group = (await client.post(url + "/rl/start_session", json={"task_id": "bench", "group_size": sessions},
                                   headers=admin)).json()

        async def agent(key: str, seed: int) -> None:
            headers = {"Authorization": f"Bearer {key}"}
            messages = [{"role": "user", "content": f"Task {seed}: add the numbers."}]
            for turn in range(turns):
                body = {"model": "m", "messages": messages, "max_tokens": max_new, "temperature": 1.0}
                r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
                r.raise_for_status()
                messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"next {turn}"}]
            await client.post(url + "/rl/set_reward", json={"reward": 1.0}, headers=headers)
            await client.post(url + "/rl/end_session", headers=headers)

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(agent(s["api_key"], i) for i, s in enumerate(group["sessions"])))
        return {"wall_s": time.perf_counter() - t0, "requests": sessions * turns, "agent_cpu_s": time.process_time() - cpu0}


async def agent_loop() -> None:
    """Persistent agent process: one JSON command per stdin line, one JSON result per stdout line."""
    loop = asyncio.get_running_loop()
    while line_ := await loop.run_in_executor(None, sys.stdin.readline):
        spec = json.loads(line_)
        if spec["kind"] == "latency":
            result = await agent_latency(spec["url"], spec["body"], spec["n"], spec["warmup"])
        else:
            result = await agent_throughput(spec["url"], spec["sessions"], spec["turns"], spec["max_new"])
        print(json.dumps(result), flush=True)


class Agent:
    """The agent process. `timeout`: seconds one case may take in it (a throughput case is sessions x turns
    requests, each under httpx's own 300 s timeout; a loaded 2-core machine needs minutes for one)."""

    def __init__(self, timeout: float = 1200.0) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.timeout = timeout

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.gateway", "--agent",
                                                         stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def run(self, spec: dict) -> object:
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            out = await asyncio.wait_for(self.proc.stdout.readline(), self.timeout)
        except TimeoutError:
            raise TimeoutError(f"bench.gateway: the agent process gave no result for the {spec['kind']!r} case "
                               f"within {self.timeout:g}s (exit code: {self.proc.returncode})") from None
        if not out:
            raise RuntimeError("the agent process exited")
        return json.loads(out)

    async def close(self, timeout: float = 30.0) -> None:
        self.proc.stdin.close()  # its command loop ends at EOF
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()  # e.g. stuck in a case that timed out above
            await self.proc.wait()


# the service process ----------------------------------------------------------------------------------------
class ServerTiming:
    """Pure ASGI wrapper: time from a model request's arrival to its last body byte handed to the server."""

    def __init__(self, app) -> None:
        self.app = app
        self.state = app.state  # serve_gateway reports the bound port here
        self.samples: list[float] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/chat/completions"):
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()

        async def timed_send(message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.samples.append((time.perf_counter() - t0) * 1e3)

        await self.app(scope, receive, timed_send)


class StubEngine:
    """Answers at once with a fixed sequence: what is left is the gateway's own path and the HTTP hop."""

    paused = False
    version = 0

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply

    def submit(self, prompt_ids, sampling, on_finish, *, priority=False):
        from services.rollout.engines.sequence import Sequence

        seq = Sequence(prompt_ids=list(prompt_ids), sampling=sampling, output_ids=list(self.reply),
                       logprobs=[-1.0] * len(self.reply), versions=[0] * len(self.reply), finish_reason="stop")
        if on_finish:
            on_finish(seq)
        return seq

    async def generate(self, prompt_ids, sampling, n: int = 1):
        return [self.submit(prompt_ids, sampling, None) for _ in range(n)]



async def direct_latency(engine, prompt: list[int], sampling, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await engine.generate(prompt, sampling)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


async def latency_case(name: str, agent: Agent, url: str, engine, fmt, messages: list[dict], stream: bool, args,
                       timing: ServerTiming) -> None:
    """Blocks of direct calls and gateway calls, alternating, so drift hits both alike."""
    from services.rollout.engines.sequence import Sampling
    from services.rollout.gateway.messages import Message

    prompt = fmt.encode(fmt.render([Message(m["role"], m["content"]) for m in messages], []))
    sampling = Sampling(temperature=0.0, max_new_tokens=args.max_new, stop_token_ids=tuple(sorted(fmt.stop_token_ids)))
    body = {"model": "m", "messages": messages, "max_tokens": args.max_new, "temperature": 0.0, "stream": stream}
    direct, gateway, block = [], [], 20
    await direct_latency(engine, prompt, sampling, 5)
    await agent.run({"kind": "latency", "url": url, "body": body, "n": 0, "warmup": 5})
    timing.samples.clear()
    for start in range(0, args.requests, block):
        n = min(block, args.requests - start)
        direct += await direct_latency(engine, prompt, sampling, n)
        gateway += await agent.run({"kind": "latency", "url": url, "body": body, "n": n, "warmup": 0})
    line(case=name, requests=args.requests, prompt_tokens=len(prompt), max_new_tokens=args.max_new,
         direct_p50_ms=pct(direct, 0.5), direct_p99_ms=pct(direct, 0.99), gateway_p50_ms=pct(gateway, 0.5),
         gateway_p99_ms=pct(gateway, 0.99), added_p50_ms=pct(gateway, 0.5) - pct(direct, 0.5),
         added_p99_ms=pct(gateway, 0.99) - pct(direct, 0.99), server_p50_ms=pct(timing.samples, 0.5),
         server_added_p50_ms=pct(timing.samples, 0.5) - pct(direct, 0.5), target_added_p50_ms=2.0)


async def direct_agents(engine, fmt, sessions: int, turns: int, max_new: int) -> float:
    """The same agents, in this process, calling engine.generate with the gateway's own prompts (no HTTP)."""
    from services.rollout.engines.sequence import Sampling
    from services.rollout.gateway.messages import Message

    sampling = Sampling(temperature=1.0, max_new_tokens=max_new, stop_token_ids=tuple(sorted(fmt.stop_token_ids)))

    async def agent(seed: int) -> None:
        messages = [Message("user", f"Task {seed}: add the numbers.")]
        for turn in range(turns):
            (seq,) = await engine.generate(fmt.encode(fmt.render(messages, [])), sampling)
            messages += [Message("assistant", fmt.decode(seq.output_ids)), Message("user", f"next {turn}")]

    t0 = time.perf_counter()
    await asyncio.gather(*(agent(i) for i in range(sessions)))
    return time.perf_counter() - t0


async def throughput_case(agent: Agent, url: str, engine, fmt, args, published: list) -> None:
    """64 agents at once through the gateway, beside the same agents calling the engine directly, and beside
    every turn's 64 prompts submitted to the engine together (its best case: one prefill per turn)."""
    from services.rollout.engines.sequence import Sampling
    from services.rollout.gateway.messages import Message

    before = len(published)
    cpu0 = time.process_time()
    result = await agent.run({"kind": "throughput", "url": url, "sessions": args.sessions, "turns": args.turns,
                              "max_new": args.max_new})
    service_cpu = time.process_time() - cpu0
    agents_wall = await direct_agents(engine, fmt, args.sessions, args.turns, args.max_new)
    prompts = [fmt.encode(fmt.render([Message("user", f"Task {i}: add the numbers.")], [])) for i in range(args.sessions)]
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new, stop_token_ids=tuple(sorted(fmt.stop_token_ids)))
    t0 = time.perf_counter()
    for _ in range(args.turns):
        await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    batched_wall = time.perf_counter() - t0
    n = args.sessions * args.turns
    rps = result["requests"] / result["wall_s"]
    line(case=f"throughput_{args.sessions}_sessions", sessions=args.sessions, turns=args.turns, requests=result["requests"],
         max_new_tokens=args.max_new, wall_s=result["wall_s"], requests_per_s=rps,
         direct_agents_requests_per_s=n / agents_wall, gateway_over_direct_agents=rps / (n / agents_wall),
         direct_batched_requests_per_s=n / batched_wall, service_cpu_s=service_cpu, agent_cpu_s=result["agent_cpu_s"],
         trajectories_published=len(published) - before)


async def stub_throughput_case(agent: Agent, url: str, args) -> None:
    """The gateway's own capacity: 64 sessions against an engine that answers at once."""
    result = await agent.run({"kind": "throughput", "url": url, "sessions": args.sessions, "turns": args.turns,
                              "max_new": args.max_new})
    line(case=f"throughput_{args.sessions}_sessions_stub_engine", sessions=args.sessions, turns=args.turns,
         requests=result["requests"], wall_s=result["wall_s"], requests_per_s=result["requests"] / result["wall_s"])


async def serve(engine, tok, published: list):
    from launcher.processes import free_port
    from services.rollout.gateway import GatewayConfig, create_app, serve_gateway

    async def publish(traj) -> None:
        published.append(traj.trajectory_id)

    config = GatewayConfig(port=free_port(), admin_key=ADMIN, max_sessions=100_000)
    app = create_app(config, engine, tok, publish)
    timing = ServerTiming(app)
    stop = asyncio.Event()
    task = asyncio.create_task(serve_gateway(timing, config, stop))  # the timing wrapper in front of the app
    return app, timing, stop, task, f"http://127.0.0.1:{config.port}"


async def wait_listening(app, task: asyncio.Task, timeout: float = 60.0) -> None:
    """Until the gateway reports its bound port; an error naming the server task's state past `timeout`."""
    deadline = time.monotonic() + timeout
    while getattr(app.state, "port", None) is None:
        if task.done() or time.monotonic() > deadline:
            failure = task.exception() if task.done() and not task.cancelled() else None
            raise RuntimeError(f"bench.gateway: the gateway did not listen within {timeout:g}s "
                               f"(server task done: {task.done()}, failure: {failure!r})")
        await asyncio.sleep(0.01)


async def main(args: argparse.Namespace) -> None:
    import torch

    from services.rollout.engines.torch_engine import EmbeddedEngine
    from services.trainer.models.tiny_qwen3 import TinyQwen3Config, build_tokenizer, padded_vocab_size

    torch.set_num_threads(1)  # as EngineConfig.build does: one OpenMP team in the process, the engine thread's
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = TinyQwen3Config(max_position_embeddings=4096).build(padded_vocab_size(tok), eos_token_id=tok.eos_token_id)
    engine = EmbeddedEngine(model.eval(), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch=64,
                            max_context=2048, seed=0)
    engine.start()
    published: list = []
    agent = Agent()
    await agent.start()
    try:
        stub = StubEngine(tok.encode("Hi!", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")])
        for label, eng in (("stub_engine", stub), ("tiny_qwen3", engine)):
            app, timing, stop, task, url = await serve(eng, tok, published)
            await wait_listening(app, task)
            fmt = app.state.gateway.fmt
            await latency_case(f"added_latency_chat_{label}", agent, url, eng, fmt, history(1), False, args, timing)
            if eng is stub:
                await stub_throughput_case(agent, url, args)
            else:
                await latency_case("added_latency_chat_stream_tiny_qwen3", agent, url, eng, fmt, history(1), True, args, timing)
                await latency_case("added_latency_chat_turn6_tiny_qwen3", agent, url, eng, fmt, history(6), False, args, timing)
                await throughput_case(agent, url, eng, fmt, args, published)
            stop.set()
            await asyncio.wait_for(task, 60)  # uvicorn's shutdown: open connections closed, then the loop ends
    finally:
        await agent.close()
        engine.stop()


if __name__ == "__main__":
    if sys.argv[1:] == ["--agent"]:
        asyncio.run(agent_loop())
        sys.exit(0)
    parser = argparse.ArgumentParser(prog="python -m bench.gateway")
    parser.add_argument("--requests", type=int, default=200, help="requests per latency case")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=8, help="tokens per completion")
    asyncio.run(main(parser.parse_args()))
