#!/usr/bin/env bash
# .venv-agents: agent frameworks (LangChain, CAMEL-AI) for examples/agents/langchain_agent.py and camel_agent.py,
# kept apart from .venv so their dependency trees never move meshrl's pins. The scripts re-execute themselves
# here; they import only examples/agents/common.py (stdlib) and their framework. Idempotent: a stamp of the pins.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AGENTS_VENV:-.venv-agents}
PY=${PY:-python3}
# camel-ai 0.2.90 imports mcp.server.FastMCP, which mcp 2 moved: hold mcp below 2
PINS="langchain==1.5.2 langchain-openai==1.8.1 camel-ai==0.2.90 mcp<2"
STAMP=$VENV/.installed
[ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && exit 0

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086  # the pins are words
"$VENV/bin/python" -m pip install --quiet $PINS
"$VENV/bin/python" -c "import langchain.agents, langchain_openai, camel.agents; print('agent frameworks ready')"
echo "$PINS" > "$STAMP"
