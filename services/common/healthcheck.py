"""`python -m services.common.healthcheck [HOST]:PORT [--service NAME]`: exit 0 when the gRPC server there answers
grpc.health.v1 SERVING, 1 otherwise (Compose healthchecks; Kubernetes uses its native gRPC probes).

An empty HOST means this machine's own address: the rollout binds its container's IP, not loopback.
"""

from __future__ import annotations

import argparse
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import FieldError


def resolve(address: str) -> str:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise FieldError("address", f"expected [HOST]:PORT, got {address!r}")
    return f"{host or socket.gethostbyname(socket.gethostname())}:{port}"


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The server's health status name (SERVING, NOT_SERVING, ...), or the gRPC error code's name."""
    with grpc.insecure_channel(resolve(address)) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("address", help="[HOST]:PORT of a meshrl gRPC server")
    parser.add_argument("--service", default="", help="a gRPC service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    status = check(args.address, args.service, args.timeout)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
