"""The reward service's public client: what other services call (the gateway's /rl/run_code and its check of a
graded session's verifier). gRPC only; nothing of the service's internals."""

from __future__ import annotations

import dataclasses

import grpc

from services.common import rpc
from services.common.auth import Tls
from services.common.contracts import reward_pb2, reward_pb2_grpc
from services.common.errors import field_error


@dataclasses.dataclass(frozen=True)
class CodeRun:
    """One program's outcome in the sandbox (see the sandbox's README for the statuses)."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    truncated: bool

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class RewardUnavailable(RuntimeError):
    """The reward service did not answer (or refused for a reason that is not the caller's input)."""


class RewardClient:
    def __init__(self, address: str, *, token: str = "", tls: Tls | None = None, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._security = {"token": token, "tls": tls}
        self._channel: grpc.aio.Channel | None = None  # opened on the first call, in the loop that makes it
        self._verifiers: frozenset[str] | None = None

    async def run_code(self, code: str, *, language: str = "python", stdin: bytes = b"",
                       timeout_s: float = 0.0) -> CodeRun:
        """ValueError for input the service refuses (its message names the field); RewardUnavailable otherwise.
        The call's own deadline is the program's plus `timeout_s` of this client (queueing for a sandbox slot)."""
        request = reward_pb2.RunCodeRequest(code=code, language=language, stdin=stdin, timeout_s=timeout_s)
        reply = await self._call("RunCode", request, self.timeout_s + timeout_s)
        return CodeRun(reply.status, reply.exit_code if reply.HasField("exit_code") else None, reply.stdout, reply.stderr,
                       reply.wall_seconds, reply.truncated)

    async def verifiers(self) -> frozenset[str]:
        """The verifier names the service can build (asked once; a plugin installed later needs a restart)."""
        if self._verifiers is None:
            reply = await self._call("ListVerifiers", reward_pb2.ListVerifiersRequest(), self.timeout_s)
            self._verifiers = frozenset(reply.verifiers)
        return self._verifiers

    async def _call(self, method: str, request, timeout_s: float):
        if self._channel is None:
            self._channel = rpc.channel(self.address, **self._security)
        stub = reward_pb2_grpc.RewardServiceStub(self._channel)
        try:
            return await getattr(stub, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the details are "field: problem"
                raise field_error(ValueError(exc.details())) or ValueError(exc.details()) from None
            raise RewardUnavailable(f"reward service at {self.address}: {exc.code().name}: {exc.details()}") from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
