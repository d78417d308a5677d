"""Who may call what on the control plane: per-identity bearer tokens, the method allow-list, TLS files.

Every process has an identity (builder, reward, rollout, trainer, weight_exchange; operator for people and the
launcher) and a bearer token, kept in a file (mode 0600) that only it reads. A server knows the other identities
only by the SHA-256 of their tokens (`auth_peers_file`), so reading one service's files never yields another's
token. A call is accepted when its token maps to an identity (compared in constant time) and that identity is on
the method's allow-list (`POLICY`); health and reflection stay open. With only `auth_token` set (one token shared
by every service, the older deployments), the token is checked but every method is open to it.

A server bound to anything but loopback refuses to start without a token. TLS is optional: certificates from
files, mTLS when `tls_client_auth` is set.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import os
import pathlib
from collections.abc import Mapping

import grpc

OPERATOR = "operator"
SHARED = "shared"   # the identity of a single token shared by all (no peers file): allowed everything
SERVICES = ("builder", "reward", "rollout", "trainer", "weight_exchange")
IDENTITIES = (*SERVICES, OPERATOR)
OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _methods(service: str, allowed: Mapping[str, tuple[str, ...]]) -> dict[str, frozenset[str]]:
    return {f"/meshrl.v1.{service}/{method}": frozenset(who) for method, who in allowed.items()}


# method -> the identities that may call it; a method missing here is refused to every identity but SHARED
POLICY: dict[str, frozenset[str]] = {
    # senders (trainer ranks) and receivers (rollout ranks) register; only the trainer asks for a deploy
    **_methods("WeightExchangeService", {"Register": ("trainer", "rollout"), "Plan": ("trainer", OPERATOR),
                                         "Sync": ("trainer",), "Status": (OPERATOR,)}),
    # a receiver's weights change only through the coordinator (which also signs each Apply: see tickets.py)
    **_methods("WeightAgentService", {"Apply": ("weight_exchange",)}),
    **_methods("RolloutService", {"Generate": (OPERATOR,), "Pause": (OPERATOR,), "Resume": (OPERATOR,),
                                  "Status": (OPERATOR,)}),
    # the gateway (in rollout) runs agents' tool calls in the sandbox and checks a graded session's verifier
    **_methods("RewardService", {"Score": (OPERATOR,), "ListVerifiers": ("rollout", OPERATOR), "Status": (OPERATOR,),
                                 "RunCode": ("rollout", OPERATOR)}),
    **_methods("BuilderService", {"Status": (OPERATOR,), "Pause": (OPERATOR,), "Resume": (OPERATOR,)}),
    **_methods("TrainerService", {"Status": (OPERATOR,), "Checkpoint": (OPERATOR,), "Pause": (OPERATOR,),
                                  "Resume": (OPERATOR,)}),
}

# the identity of the current call (None: the server checks no token); set by the server's interceptor
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("meshrl_caller", default=None)


class AuthError(ValueError):
    """A credential file or setting that cannot be used; the service does not start."""


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def read_secret(path: str | os.PathLike) -> str:
    """The secret in `path` (surrounding whitespace removed); AuthError when missing or empty (never its value)."""
    try:
        value = pathlib.Path(path).read_text().strip()
    except OSError as exc:
        raise AuthError(f"{path}: cannot read the secret: {exc.strerror or exc}") from exc
    if not value:
        raise AuthError(f"{path}: empty")
    return value


class TokenTable:
    """identity -> SHA-256 of its token; `identify` compares against every entry in constant time."""

    def __init__(self, digests: Mapping[str, str]) -> None:
        self._digests = []
        for identity, digest in digests.items():
            try:
                raw = bytes.fromhex(digest)
            except ValueError as exc:
                raise AuthError(f"peers: {identity}: not a hex SHA-256") from exc
            if len(raw) != 32:
                raise AuthError(f"peers: {identity}: not a hex SHA-256")
            self._digests.append((identity, raw))
        if not self._digests:
            raise AuthError("peers: no identity")

    @classmethod
    def from_tokens(cls, tokens: Mapping[str, str]) -> TokenTable:
        return cls({identity: token_digest(token) for identity, token in tokens.items()})

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenTable:
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise AuthError(f"auth_peers_file: {path}: {exc}") from exc
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise AuthError(f"auth_peers_file: {path}: expected a JSON object of identity -> hex SHA-256")
        return cls(data)

    @property
    def identities(self) -> list[str]:
        return [identity for identity, _ in self._digests]

    def identify(self, token: str) -> str | None:
        got = hashlib.sha256(token.encode()).digest()
        found = None
        for identity, digest in self._digests:  # no early exit: the time does not depend on which entry matched
            if hmac.compare_digest(got, digest):
                found = identity
        return found


@dataclasses.dataclass(frozen=True)
class Tls:
    """PEM bytes from the configured files; a server needs cert and key, a client at least the CA."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    client_auth: bool = False
    server_name: str = ""

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise AuthError("tls_cert_file, tls_key_file: a TLS server needs both")
        if self.client_auth and not self.ca:
            raise AuthError("tls_ca_file: mTLS (tls_client_auth) needs the CA that signs client certificates")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca if self.client_auth
                                           else None, require_client_auth=self.client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key if self.cert else None,
                                            certificate_chain=self.cert if self.key else None)


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    tokens: TokenTable | None = None              # None: no token is checked (loopback only)
    policy: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=lambda: POLICY)
    tls: Tls | None = None
    reflection: bool = True


def tls_from_config(config) -> Tls | None:
    files = (config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    if not any(files):
        return None

    def read(path: str) -> bytes | None:
        if not path:
            return None
        try:
            return pathlib.Path(path).read_bytes()
        except OSError as exc:
            raise AuthError(f"{path}: {exc.strerror or exc}") from exc

    cert, key, ca = (read(p) for p in files)
    return Tls(cert=cert, key=key, ca=ca, client_auth=config.tls_client_auth, server_name=config.tls_server_name)


def own_token(config) -> str:
    """This service's bearer token: from `auth_token_file`, else `auth_token` ("" when neither is set)."""
    if config.auth_token_file:
        return read_secret(config.auth_token_file)
    return config.auth_token


def server_security(config) -> ServerSecurity:
    """The server side of a ServiceConfig: the peers' token table (or the one shared token), TLS, reflection."""
    tokens: TokenTable | None
    if config.auth_peers_file:
        tokens = TokenTable.load(config.auth_peers_file)
    else:
        token = own_token(config)
        tokens = TokenTable.from_tokens({SHARED: token}) if token else None
    return ServerSecurity(tokens=tokens, tls=tls_from_config(config), reflection=config.grpc_reflection)


def client_security(config) -> dict:
    """`token` and `tls` for `services.common.rpc.channel` calls made by this service."""
    return {"token": own_token(config), "tls": tls_from_config(config)}


def allowed(identity: str, method: str, policy: Mapping[str, frozenset[str]] = POLICY) -> bool:
    return identity == SHARED or identity in policy.get(method, ())


def caller() -> str | None:
    """The identity of the gRPC call being handled (None when the server checks no token)."""
    return CALLER.get()


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def nats_credentials(config) -> dict:
    """Keyword arguments for `Bus.connect` from a ServiceConfig's NATS fields (secrets read from their files)."""
    out: dict = {}
    if config.nats_creds_file:
        out["creds_file"] = config.nats_creds_file
    if config.nats_user:
        out["user"] = config.nats_user
        out["password"] = read_secret(config.nats_password_file) if config.nats_password_file \
            else config.nats_password
    return out
