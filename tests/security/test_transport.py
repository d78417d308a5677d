"""gRPC transport security: TLS and mTLS from certificate files (a CA made here with trustme), tokens over TLS,
and no unauthenticated server on a non-loopback address."""

from __future__ import annotations

import grpc
import pytest

from services.common.auth import AuthError, ServerSecurity, Tls, TokenTable, server_security, tls_from_config
from services.common.config import ServiceConfig
from services.common.contracts import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.rpc import Servicer, channel, start_server

trustme = pytest.importorskip("trustme")


class Trainer(trainer_pb2_grpc.TrainerServiceServicer):
    async def Status(self, request, context):  # noqa: N802
        return trainer_pb2.TrainerStatus(policy_version=7)


SERVICER = Servicer(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, Trainer(), "meshrl.v1.TrainerService")


@pytest.fixture
def pki(tmp_path):
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("operator.meshrl")
    other_ca = trustme.CA()
    files = {}
    for name, blob in {"ca.pem": ca.cert_pem, "other-ca.pem": other_ca.cert_pem,
                       "server.pem": server.cert_chain_pems[0], "server.key": server.private_key_pem,
                       "client.pem": client.cert_chain_pems[0], "client.key": client.private_key_pem}.items():
        path = tmp_path / name
        blob.write_to_path(str(path))
        files[name] = str(path)
    return files


def tokens() -> TokenTable:
    return TokenTable.from_tokens({"operator": "op-token", "trainer": "tr-token"})


async def status(address: str, **kw) -> int:
    async with channel(address, **kw) as ch:
        reply = await trainer_pb2_grpc.TrainerServiceStub(ch).Status(common_pb2.StatusRequest(), timeout=5)
    return reply.policy_version


async def test_tls_server_with_tokens(pki):
    config = ServiceConfig(tls_cert_file=pki["server.pem"], tls_key_file=pki["server.key"])
    server = await start_server("127.0.0.1:0", [SERVICER], security=ServerSecurity(tokens=tokens(),
                                                                                  tls=tls_from_config(config)))
    address = f"127.0.0.1:{server.port}"
    trusted = Tls(ca=open(pki["ca.pem"], "rb").read())
    try:
        assert await status(address, token="op-token", tls=trusted) == 7
        with pytest.raises(grpc.aio.AioRpcError) as err:          # the right CA, no token
            await status(address, tls=trusted)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:          # another identity's token
            await status(address, token="tr-token", tls=trusted)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:          # plaintext against a TLS server
            await status(address, token="op-token")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:          # a server certificate from another CA
            await status(address, token="op-token", tls=Tls(ca=open(pki["other-ca.pem"], "rb").read()))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_mtls_requires_a_client_certificate_from_the_ca(pki):
    config = ServiceConfig(tls_cert_file=pki["server.pem"], tls_key_file=pki["server.key"], tls_ca_file=pki["ca.pem"],
                           tls_client_auth=True, auth_token="shared-token")
    server = await start_server("127.0.0.1:0", [SERVICER], security=server_security(config))
    address = f"127.0.0.1:{server.port}"
    ca = open(pki["ca.pem"], "rb").read()
    try:
        client = ServiceConfig(tls_cert_file=pki["client.pem"], tls_key_file=pki["client.key"], tls_ca_file=pki["ca.pem"])
        assert await status(address, token="shared-token", tls=tls_from_config(client)) == 7
        with pytest.raises(grpc.aio.AioRpcError) as err:          # TLS, but no client certificate
            await status(address, token="shared-token", tls=Tls(ca=ca))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:          # a client certificate, a wrong token
            await status(address, token="nope", tls=tls_from_config(client))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
async def test_no_server_without_a_token_off_loopback(address):
    with pytest.raises(AuthError, match="not a loopback address"):
        await start_server(address, [SERVICER])
    server = await start_server(address, [SERVICER], auth_token="t0ken")  # with a token it serves
    await server.stop(0)


@pytest.mark.parametrize("address", ["127.0.0.1:0", "localhost:0", "[::1]:0"])
async def test_loopback_may_serve_without_a_token(address):
    try:
        server = await start_server(address, [SERVICER])
    except ValueError as exc:  # no IPv6 loopback on this host
        if "[::1]" in address:
            pytest.skip(str(exc))
        raise
    await server.stop(0)


def test_token_table_matches_in_constant_time_by_digest():
    table = tokens()
    assert table.identify("op-token") == "operator" and table.identify("tr-token") == "trainer"
    assert table.identify("") is None and table.identify("op-token ") is None
    with pytest.raises(AuthError):
        TokenTable({"x": "not-hex"})
