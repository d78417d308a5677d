#!/usr/bin/env bash
# .venv-trl: Hugging Face TRL for bench/trl_compare.py, kept apart from .venv so its pins never move meshrl's.
# torch is the same CPU build as .venv's (pip's configured find-links / index, as `make setup` installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TRL_VENV:-.venv-trl}
PY=${PY:-python3}
STAMP=$VENV/.installed-trl-1.16.0
[ -f "$STAMP" ] && exit 0
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet trl==1.16.0 transformers==5.24.0 accelerate==1.15.0 datasets==5.2.0 \
    safetensors==0.8.0 tokenizers==0.23.3 numpy==2.4.6
touch "$STAMP"
