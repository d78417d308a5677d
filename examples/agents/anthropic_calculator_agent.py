"""The same arithmetic agent written with the official `anthropic` SDK (tool_use / tool_result blocks).

The Anthropic client sends the session key as `x-api-key`; `base_url` is the gateway root.

    python examples/agents/anthropic_calculator_agent.py --base-url http://127.0.0.1:8000 --episodes 20
"""

from __future__ import annotations

import sys
from pathlib import Path

from anthropic import Anthropic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SYSTEM, arguments, play, run_tool  # noqa: E402
from common import TOOLS as OPENAI_TOOLS

TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]


def episode(client: Anthropic, model: str, question: str, max_turns: int, max_tokens: int, *,
            system: str | None = SYSTEM, use_tools: bool = True,
            temperature: float | None = None) -> tuple[str, int, int]:
    messages: list[dict] = [{"role": "user", "content": question}]
    # anthropic 2.x's create() no longer names `temperature`; the Messages API (and the gateway) still read it
    options = {**({"system": system} if system else {}), **({"tools": TOOLS} if use_tools else {}),
               **({"extra_body": {"temperature": temperature}} if temperature is not None else {})}
    calls = 0
    for turn in range(1, max_turns + 1):
        reply = client.messages.create(model=model, messages=messages, max_tokens=max_tokens, **options)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text"), turn, calls
        calls += len(uses)
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": run_tool(b.name, b.input)} for b in uses]})
    return "", max_turns, calls


def main() -> None:
    args = arguments(__doc__)
    play(args, lambda key: Anthropic(base_url=args.base_url, api_key=key, max_retries=5), episode)


if __name__ == "__main__":
    main()
