#!/bin/sh
# meshrl-entrypoint SERVICE [ARGS]: `python -m services.SERVICE [ARGS]`; anything else runs as given (nats-server, sh).
# Two addresses must be reachable from other containers, so they default to this container's own IP (POD_IP on
# Kubernetes): the rollout's gRPC server (the weight exchange calls its agent back) and the trainer's weight endpoints.
set -eu
case "${1:-}" in
  rollout|reward|builder|trainer|weight_exchange) service=$1; shift ;;
  *) exec "$@" ;;
esac
ip=${POD_IP:-$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')}
case "$service" in
  rollout) export MESHRL_ROLLOUT__GRPC_ADDRESS="${MESHRL_ROLLOUT__GRPC_ADDRESS:-$ip:50051}" ;;
  trainer) export MESHRL_TRAINER__WEIGHT_HOST="${MESHRL_TRAINER__WEIGHT_HOST:-$ip}" ;;
esac
# a trainer of several ranks is one rank group in this container: torchrun starts them (RANK, LOCAL_RANK,
# WORLD_SIZE, MASTER_ADDR/PORT), rank 0 serves; one rank failing stops the group, and the container with it
ranks=${MESHRL_TRAINER__RANKS:-1}
if [ "$service" = trainer ] && [ "$ranks" -gt 1 ]; then
  exec torchrun --standalone --nnodes=1 --nproc-per-node="$ranks" --max-restarts=0 -m "services.$service" "$@"
fi
exec python -m "services.$service" "$@"
