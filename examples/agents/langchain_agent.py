"""The calculator agent written with LangChain (`create_agent`, a `@tool`, `ChatOpenAI`), trained unchanged.

As with any OpenAI-compatible provider, `ChatOpenAI` gets the gateway as `base_url` and a session key as `api_key`;
nothing else in the agent knows about meshrl. Episodes, rewards and the /rl calls are `common.py`'s, as for the
SDK agents.

    python examples/agents/langchain_agent.py --base-url http://127.0.0.1:8000 --episodes 20

LangChain lives in its own environment, `.venv-agents` (`make agents-env`): run from the main one, this script
re-executes itself there.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_in_environment  # noqa: E402

run_in_environment(__file__, "langchain_openai", ".venv-agents", "agents-env")

from common import SYSTEM, arguments, play, run_tool  # noqa: E402
from langchain.agents import create_agent  # noqa: E402
from langchain_core.messages import AIMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.errors import GraphRecursionError  # noqa: E402


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return run_tool("calculator", {"expression": expression})


def episode(llm: ChatOpenAI, model: str, question: str, max_turns: int, max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True) -> tuple[str, int, int]:
    """Returns (final answer text, model calls, tool calls)."""
    agent = create_agent(llm.bind(max_tokens=max_tokens), tools=[calculator] if use_tools else [], system_prompt=system)
    try:  # each turn is a model step and a tool step in LangGraph's count
        state = agent.invoke({"messages": [{"role": "user", "content": question}]},
                             config={"recursion_limit": 2 * max_turns})
    except GraphRecursionError:
        return "", max_turns, max_turns
    messages = state["messages"]
    calls = sum(isinstance(m, AIMessage) for m in messages)
    tools = sum(isinstance(m, ToolMessage) for m in messages)
    return str(messages[-1].content) if isinstance(messages[-1], AIMessage) else "", calls, tools


def main() -> None:
    args = arguments(__doc__)
    play(args, lambda key: ChatOpenAI(model=args.model, base_url=args.base_url.rstrip("/") + "/v1", api_key=key,
                                      max_retries=5), episode)


if __name__ == "__main__":
    main()
