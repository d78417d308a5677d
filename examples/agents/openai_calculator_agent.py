"""A multi-turn, tool-using arithmetic agent written with the official `openai` SDK.

To train it with meshrl, only two things change from calling a model provider: `base_url` points at the
gateway and `api_key` is a session key. After each episode it reports its reward to /rl/set_reward.

    python examples/agents/openai_calculator_agent.py --base-url http://127.0.0.1:8000 --episodes 20
"""

from __future__ import annotations

import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SYSTEM, TOOLS, arguments, chat_episode, play, run_tool  # noqa: E402


def episode(client: OpenAI, model: str, question: str, max_turns: int, max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True,
            temperature: float | None = None) -> tuple[str, int, int]:
    """Returns (final answer text, model calls, tool calls)."""
    return chat_episode(client, model, question, max_turns, max_tokens, system=system,
                        tools=TOOLS if use_tools else None, run=run_tool,
                        temperature=temperature)


def main() -> None:
    args = arguments(__doc__)
    play(args, lambda key: OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=key, max_retries=5), episode)


if __name__ == "__main__":
    main()
