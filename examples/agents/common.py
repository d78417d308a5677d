"""What both example agents share: the arithmetic task, a safe calculator, and the gateway's /rl routes.

Nothing here is meshrl-specific except `start_session` / `set_reward` / `end_session`, which are plain HTTP
calls an agent adds to report its reward.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import inspect
import json
import operator
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEM = ("You are a careful arithmetic assistant. Use the calculator tool for every computation, then reply with "
          "'Answer: <number>'.")
TOOLS = [{"type": "function", "function": {  # OpenAI's format; the Anthropic agent sends the same schema
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def arguments(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None,
              tasks: dict | None = None) -> argparse.Namespace:
    """The example agents' flags; `extra` adds an agent's own, `tasks` replaces the arithmetic ones."""
    tasks = TASKS if tasks is None else tasks
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--base-url", default=os.environ.get("MESHRL_GATEWAY_URL", "http://127.0.0.1:8000"),
                   help="the gateway (the OpenAI base URL is <base-url>/v1)")
    p.add_argument("--admin-key", default=os.environ.get("MESHRL_ADMIN_KEY"),
                   help="starts sessions (env MESHRL_ADMIN_KEY; else read from --admin-key-file)")
    p.add_argument("--admin-key-file", default=os.environ.get("MESHRL_ADMIN_KEY_FILE"),
                   help="file holding the admin key (env MESHRL_ADMIN_KEY_FILE; default: the file a gateway on this "
                        "machine generated, e.g. runs/up/secrets/gateway_admin_key)")
    p.add_argument("--api-key", default=os.environ.get("MESHRL_SESSION_KEY"),
                   help="use this fixed session key (re-started for every episode, like OpenClaw) instead of fresh ones")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4, help="episodes per task (a GRPO group)")
    p.add_argument("--parallel", type=int, default=1, help="episodes played at once (whole groups are started)")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=_env_float("MESHRL_TEMPERATURE"),
                   help="sampling temperature sent with every model call (env MESHRL_TEMPERATURE, which `meshrl run` "
                        "sets to the run's builder.sampling.temperature; default: not sent, the API's 1.0); the "
                        "trainer's log-probs are at the run's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="meshrl-policy")
    p.add_argument("--task", choices=sorted(tasks), default=next(iter(tasks)),
                   help="; ".join(f"{name}: {spec.help}" for name, spec in tasks.items()))
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.api_key and args.parallel > 1:
        p.error("--parallel: a fixed --api-key plays one episode at a time (starting it again ends the last one)")
    args.admin_key = args.admin_key or read_admin_key(args.base_url, args.admin_key_file)
    if not args.admin_key:
        p.error("no admin key: pass --admin-key or --admin-key-file, or set MESHRL_ADMIN_KEY / MESHRL_ADMIN_KEY_FILE "
                "(a gateway that generated its key says where it wrote it when it starts)")
    return args


def _env_float(name: str) -> float | None:
    """A float flag's default from the environment; exits naming the variable when it is not a number."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        sys.exit(f"{name}: must be a number, got {value!r}")


def run_in_environment(script: str, module: str, venv: str, make_target: str) -> None:
    """Re-execute `script` with the repository's `venv` unless `module` imports here: an agent framework lives in
    its own environment so that its dependency tree never moves meshrl's pins."""
    try:
        __import__(module)
    except ImportError:
        python = Path(__file__).resolve().parents[2] / venv / "bin" / "python"
        if not python.exists():
            sys.exit(f"{Path(script).name}: {module} is not installed; run `make {make_target}` (it creates {venv})")
        os.execv(str(python), [str(python), script, *sys.argv[1:]])


def read_admin_key(base_url: str, path: str | None) -> str | None:
    """The key in `path`; without one, in the file a gateway on this machine names in its discovery note
    (`$MESHRL_RUNTIME_DIR` or ~/.cache/meshrl/runtime, `gateway-<port>.json`: the key file's path, never the key)."""
    if not path:
        port = urllib.parse.urlsplit(base_url).port or 80
        folder = Path(os.environ.get("MESHRL_RUNTIME_DIR") or Path.home() / ".cache" / "meshrl" / "runtime")
        try:
            path = json.loads((folder / f"gateway-{port}.json").read_text())["admin_key_file"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def task(rng: random.Random) -> tuple[str, str, float]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    op = rng.choice(["+", "-", "*"])
    expression = f"({a} {op} {b}) * {c}"
    return f"task-{a}{op}{b}x{c}", f"What is ({a} {op} {b}) * {c}?", calculate(expression)


def addition_task(rng: random.Random) -> tuple[str, str, float]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"add-{a}-{b}", f"{a}+{b}=", float(a + b)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    make: Callable[[random.Random], tuple[str, str, Any]]  # (task id, question, expected answer or grading)
    system: str | None   # system prompt
    tools: bool          # offer the agent's tools
    help: str = ""
    graded: bool = False  # `make` gives the session's grading: the reward service scores the episode, not the agent


TASKS = {"calculator": TaskSpec(task, SYSTEM, True, "multi-turn with the calculator tool (make run-agent)"),
         "addition": TaskSpec(addition_task, None, False, "'a+b=' answered in one turn without tools")}


def calculate(expression: str) -> float:
    """Evaluates + - * / and parentheses on numbers; anything else raises ValueError."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")
    try:
        return ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError, RecursionError) as exc:
        raise ValueError(str(exc)) from exc


def run_tool(name: str, args: dict | str) -> str:
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    expression = args.get("expression") if isinstance(args, dict) else args
    try:
        value = calculate(str(expression))
    except ValueError as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else str(value)


def chat_episode(client, model: str, question: str, max_turns: int, max_tokens: int, *, system: str | None,
                 tools: list[dict] | None, run: Callable[[str, dict | str], str],
                 temperature: float | None = None) -> tuple[str, int, int]:
    """One episode with an OpenAI-SDK client: call the model, run its tool calls with `run(name, arguments)`
    (arguments as parsed JSON, or the raw text when it is not JSON), until it answers without one. Returns
    (final answer text, model calls, tool calls)."""
    messages: list[dict] = [*([{"role": "system", "content": system}] if system else []),
                            {"role": "user", "content": question}]
    sampling = {"temperature": temperature} if temperature is not None else {}
    calls = 0
    for turn in range(1, max_turns + 1):
        message = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **sampling,
                                                 **({"tools": tools} if tools else {})).choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # sent back verbatim: the gateway reuses its tokens
        if not message.tool_calls:
            return message.content or "", turn, calls
        for call in message.tool_calls:
            calls += 1
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = call.function.arguments
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run(call.function.name, args)})
    return "", max_turns, calls


def reward(answer: str, expected: float) -> float:
    """1 for the right number after 'Answer:' (or the last number), 0.1 for a well-formed wrong one, else 0."""
    found = re.findall(r"Answer:\s*(-?\d+(?:\.\d+)?)", answer) or re.findall(r"-?\d+(?:\.\d+)?", answer)
    if not found:
        return 0.0
    return 1.0 if abs(float(found[-1]) - expected) < 1e-6 else 0.1


def post(base_url: str, path: str, key: str, body: dict) -> dict:
    req = urllib.request.Request(base_url.rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read() or b"{}")


def start_sessions(args: argparse.Namespace, task_id: str, grading: dict | None = None) -> list[str]:
    """Session keys for one task: a group of fresh keys, or the fixed --api-key started again. `grading`: the
    verifier and its data (the reward service then grades each episode's last answer)."""
    body: dict[str, Any] = {"task_id": task_id, **({"grading": grading} if grading else {})}
    if args.api_key:
        post(args.base_url, "/rl/start_session", args.admin_key, {**body, "api_key": args.api_key})
        return [args.api_key]
    group = post(args.base_url, "/rl/start_session", args.admin_key, {**body, "group_size": args.group_size})
    return [s["api_key"] for s in group["sessions"]]


def finish(args: argparse.Namespace, key: str, value: float | None, *, attempts: int = 10) -> dict:
    """Report the reward (None: a graded session, the verifier's) and end the session. A 503 from end_session
    means the export is not yet stored: the session stays open and the same call, again after Retry-After, waits
    for that same export."""
    if value is not None:
        post(args.base_url, "/rl/set_reward", key, {"reward": value})
    for _ in range(attempts - 1):
        try:
            return post(args.base_url, "/rl/end_session", key, {})
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise
            time.sleep(min(30.0, float(exc.headers.get("Retry-After") or 1)))
    return post(args.base_url, "/rl/end_session", key, {})


def play(args: argparse.Namespace, make_client, episode, tasks: dict | None = None) -> None:
    """Run `args.episodes` episodes, `args.parallel` at a time: a session per group member, the agent's turns, the
    reward (the agent's own, or its verifier's for a graded task), one JSON line each."""
    rng = random.Random(args.seed)
    spec = (TASKS if tasks is None else tasks)[args.task]
    sampling = {"temperature": args.temperature} if args.temperature is not None else {}
    if sampling and "temperature" not in inspect.signature(episode).parameters:
        sys.exit(f"--temperature (or MESHRL_TEMPERATURE, a run's builder.sampling.temperature): "
                 f"{Path(sys.argv[0]).name} does not set its model's temperature (the SDK agents do)")
    rewards: list[float] = []
    episodes: list[int] = []
    lock = threading.Lock()

    def one(key: str, task_id: str, question: str, expected: Any) -> None:
        started_at = time.monotonic()
        answer, turns, tools = episode(make_client(key), args.model, question, args.max_turns, args.max_tokens,
                                       system=spec.system, use_tools=spec.tools, **sampling)
        value = None if spec.graded else reward(answer, expected)
        ended = finish(args, key, value)
        with lock:
            episodes.append(1)
            rewards.extend([] if value is None else [value])
            graded = {"graded_by": expected["verifier"]} if spec.graded else \
                {"reward": value, "mean_reward_last_20": sum(rewards[-20:]) / len(rewards[-20:])}
            record = {"episode": len(episodes), "task_id": task_id, "turns": turns, "tool_calls": tools, **graded,
                      "trajectories": ended.get("trajectories"),
                      "seconds": round(time.monotonic() - started_at, 2)}
            # one write with its newline: agents sharing a log file (make run-agent) never split each other's lines
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        pending: set[concurrent.futures.Future] = set()
        started = 0
        while started < args.episodes or pending:
            while started < args.episodes and len(pending) < args.parallel:
                task_id, question, expected = spec.make(rng)
                for key in start_sessions(args, task_id, expected if spec.graded else None):  # a group's sessions start together and run side by side
                    pending.add(pool.submit(one, key, task_id, question, expected))
                    started += 1
            done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                future.result()  # an agent error stops the agent, as it would without meshrl
