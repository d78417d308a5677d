#!/usr/bin/env bash
# Wheels bench/gpu_check needs on the GPU machine beyond what it has (torch, transformers,
# msgpack, numpy, safetensors): grpcio, its health and reflection services and protobuf at our pins (the generated contracts refuse older runtimes; the
# image had grpcio 1.84), structlog (services.common.logging, imported by the engine and the weight
# exchange client), megatron-core (its check; skipped without it) and nats-py (not imported by gpu_check; carried
# for a services run). Versions from requirements.txt. Downloads into .whl/ and prints the total size (< 50 MB).
#   scripts/gpu_wheels.sh            then, on the GPU machine:
#   python -m pip install --no-deps --no-index .whl/*.whl && python -m bench.gpu_check
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pin() { grep -E "^$1==" requirements.txt | head -n1; }
mkdir -p .whl
for name in structlog nats-py megatron-core grpcio protobuf grpcio-health-checking grpcio-reflection; do
  spec="$(pin "$name")"
  [ -n "$spec" ] || { echo "requirements.txt pins no $name" >&2; exit 1; }
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec"
done
ls -l .whl/*.whl
bytes=$(du -cb .whl/*.whl | tail -n1 | cut -f1)
echo "total: $((bytes / 1024)) KiB in $(ls .whl/*.whl | wc -l) wheels"
[ "$bytes" -lt $((50 * 1024 * 1024)) ] || { echo "over 50 MB" >&2; exit 1; }
