"""The calculator agent written with CAMEL-AI (`ChatAgent`, a `FunctionTool`, an OpenAI-compatible model backend),
trained unchanged.

The model backend is CAMEL's `OPENAI_COMPATIBLE_MODEL` platform with the gateway as `url` and a session key as
`api_key`; nothing else in the agent knows about meshrl. Episodes, rewards and the /rl calls are `common.py`'s.

    python examples/agents/camel_agent.py --base-url http://127.0.0.1:8000 --episodes 20

CAMEL lives in its own environment, `.venv-agents` (`make agents-env`): run from the main one, this script
re-executes itself there.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_in_environment  # noqa: E402

run_in_environment(__file__, "camel", ".venv-agents", "agents-env")

from camel.agents import ChatAgent  # noqa: E402
from camel.models import BaseModelBackend, ModelFactory  # noqa: E402
from camel.toolkits import FunctionTool  # noqa: E402
from camel.types import ModelPlatformType  # noqa: E402
from camel.utils import BaseTokenCounter  # noqa: E402
from common import SYSTEM, arguments, play, run_tool  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression (str): the expression, e.g. "(3 + 4) * 2".
    """
    return run_tool("calculator", {"expression": expression})


class ByteCounter(BaseTokenCounter):
    """CAMEL's context bookkeeping, one "token" per UTF-8 byte (an overestimate, so it never over-fills). Its
    default counter would load a tiktoken encoding, which is downloaded on first use; the model itself is counted
    by the gateway."""

    def count_tokens_from_messages(self, messages) -> int:
        return sum(len(self.encode(str(m.get("content") or ""))) + 4 for m in messages)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="replace")


def backend(args, key: str) -> BaseModelBackend:
    return ModelFactory.create(model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL, model_type=args.model,
                               url=args.base_url.rstrip("/") + "/v1", api_key=key, token_counter=ByteCounter(),
                               max_retries=5, model_config_dict={"max_tokens": args.max_tokens})


def episode(model: BaseModelBackend, _model_name: str, question: str, max_turns: int, _max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True) -> tuple[str, int, int]:
    """Returns (final answer text, model calls, tool calls). CAMEL calls the model again after each tool result,
    up to `max_iteration` model calls per step."""
    agent = ChatAgent(system_message=system, model=model, tools=[FunctionTool(calculator)] if use_tools else None,
                      max_iteration=max_turns)
    response = agent.step(question)
    tools = len(response.info.get("tool_calls") or [])
    answer = response.msgs[0].content if response.msgs else ""
    return answer, tools + 1, tools


def main() -> None:
    args = arguments(__doc__)
    play(args, lambda key: backend(args, key), episode)


if __name__ == "__main__":
    main()
