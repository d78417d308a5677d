"""The auth matrix: every gRPC method of every service, every NATS subject meshrl uses (and the JetStream API
subjects that could destroy or forge data), the weight plane's data servers and Apply. For each: no credentials,
wrong credentials and another identity's credentials are refused; the right ones work.

Real servers on loopback: gRPC servers started by `services.common.rpc.start_server` with the security a launched
service gets (its token file, the peers' digests), the weight exchange's real servicer and coordinator, a real
receiver agent, a real nats-server started from the config the launcher generates. The expected matrix is written
out here, independently of `services.common.auth.POLICY` and `services.common.credentials`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets

import grpc
import httpx
import nats
import nats.errors
import pytest
import torch
from google.protobuf import message_factory

from launcher.processes import NatsServer
from services.common.auth import IDENTITIES, OPERATOR, POLICY, server_security
from services.common.config import ServiceConfig
from services.common.contracts import (
    builder_pb2,
    builder_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from services.common.contracts import weight_exchange_pb2 as wx_pb2
from services.common.contracts import weight_exchange_pb2_grpc as wx_grpc
from services.common.credentials import RunCredentials
from services.common.rpc import Servicer, start_server
from services.weight_exchange.client import ReceiverAgent
from services.weight_exchange.client.layout import RECEIVER, SENDER, RankLayout
from services.weight_exchange.client.layouts.hf import hf_full_shards
from services.weight_exchange.client.sink import pull_all
from services.weight_exchange.client.source import SenderServer
from services.weight_exchange.client.tickets import new_key, new_sync_id, sign_apply, ticket
from services.weight_exchange.client.wire import TransportError
from services.weight_exchange.coordinator import Coordinator
from services.weight_exchange.planner import plan
from services.weight_exchange.server import WeightExchangeServicer

SERVICES = ("builder", "reward", "rollout", "trainer", "weight_exchange")
ANY = "*"

# gRPC: service -> method -> the identities allowed (everyone else, and no / a wrong token, is refused)
GRPC_EXPECTED = {
    "WeightExchangeService": {"Register": {"trainer", "rollout"}, "Plan": {"trainer", OPERATOR}, "Sync": {"trainer"},
                              "Status": {OPERATOR}},
    "WeightAgentService": {"Apply": {"weight_exchange"}},
    "RolloutService": {"Generate": {OPERATOR}, "Pause": {OPERATOR}, "Resume": {OPERATOR}, "Status": {OPERATOR}},
    "RewardService": {"Score": {OPERATOR}, "ListVerifiers": {"rollout", OPERATOR}, "Status": {OPERATOR},
                      "RunCode": {"rollout", OPERATOR}},
    "BuilderService": {"Status": {OPERATOR}, "Pause": {OPERATOR}, "Resume": {OPERATOR}},
    "TrainerService": {"Status": {OPERATOR}, "Checkpoint": {OPERATOR}, "Pause": {OPERATOR}, "Resume": {OPERATOR}},
}
DESCRIPTORS = {"WeightExchangeService": wx_pb2, "WeightAgentService": wx_pb2, "RolloutService": rollout_pb2,
               "RewardService": reward_pb2, "BuilderService": builder_pb2, "TrainerService": trainer_pb2}
ADDERS = {"RolloutService": rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
          "RewardService": reward_pb2_grpc.add_RewardServiceServicer_to_server,
          "BuilderService": builder_pb2_grpc.add_BuilderServiceServicer_to_server,
          "TrainerService": trainer_pb2_grpc.add_TrainerServiceServicer_to_server}
DENIED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

STREAMS = ("PROMPTS", "TRAJ", "BATCHES", "EVENTS", "DLQ")
DURABLES = {"rollout": "PROMPTS", "reward": "TRAJ", "builder": "TRAJ"}
JS = "$JS.API"
# NATS publishes: subject -> the identities allowed besides the operator (the run's administrator)
NATS_PUBLISH = {
    "prompts.work": {"builder"}, "batches.train.0": {"builder"},
    "traj.raw": {"rollout"}, "traj.scored": {"rollout", "reward", "builder"},   # builder: preference pairs
    "events.version": {"trainer", "builder", "weight_exchange"},   # one subject for every kind of event
    **{f"dlq.{s}": {s} for s in ("builder", "reward", "rollout", "trainer")},
    "$KV.meshrl_builder.issued": {"builder"}, "$O.BATCH_BLOBS.C.x": {"builder"},
    f"{JS}.STREAM.MSG.GET.BATCHES": {"builder", "trainer"},
    **{f"{JS}.STREAM.UPDATE.{s}": {"builder"} for s in STREAMS},
    **{f"{JS}.STREAM.CREATE.{s}": set(SERVICES) for s in STREAMS},
    f"{JS}.STREAM.CREATE.EVIL": set(), f"{JS}.STREAM.CREATE.KV_meshrl_builder": {"builder"},
    **{f"{JS}.STREAM.{op}.{s}": set() for op in ("DELETE", "PURGE", "MSG.DELETE")
       for s in (*STREAMS, "KV_meshrl_builder")},
    f"{JS}.STREAM.PURGE.OBJ_BATCH_BLOBS": {"builder"}, f"{JS}.STREAM.DELETE.OBJ_BATCH_BLOBS": set(),
    **{f"{JS}.CONSUMER.DELETE.{stream}.{d}": set() for d, stream in DURABLES.items()},
    # create-or-update: only the consuming service, or it could rewrite another's filter or max_ack_pending
    **{f"{JS}.CONSUMER.DURABLE.CREATE.{stream}.{d}": {d} for d, stream in DURABLES.items()},
    **{f"{JS}.CONSUMER.MSG.NEXT.{stream}.{d}": {d} for d, stream in DURABLES.items()},
    **{f"$JS.ACK.{stream}.{d}.1.1.1.1.1": {d} for d, stream in DURABLES.items()},
    f"{JS}.CONSUMER.CREATE.PROMPTS": set(), f"{JS}.CONSUMER.CREATE.TRAJ": set(),
    f"{JS}.CONSUMER.CREATE.EVENTS": {"builder", "rollout"}, f"{JS}.CONSUMER.CREATE.DLQ": {"builder"},
    f"{JS}.ACCOUNT.PURGE.x": set(), "$SYS.REQ.SERVER.PING": set(),
}
# NATS subscriptions: subject -> the identities allowed besides the operator
NATS_SUBSCRIBE = {
    "prompts.work": set(), "traj.raw": set(), "traj.scored": set(), "events.version": set(), "dlq.>": set(),
    "batches.train.*": {"trainer"}, ">": set(), "_INBOX.>": set(), "$JS.ACK.>": set(),
    **{f"_INBOX.{s}.>": {s} for s in SERVICES},
}


@dataclasses.dataclass
class Tally:
    cells: int = 0
    refused: int = 0

    def add(self, refused: bool) -> None:
        self.cells += 1
        self.refused += int(refused)


TALLY: dict[str, Tally] = {"grpc": Tally(), "nats": Tally(), "weight plane": Tally(), "gateway": Tally()}


def report(capsys, plane: str) -> None:
    t = TALLY[plane]
    with capsys.disabled():
        print(f"\nauth matrix [{plane}]: {t.cells} cells, {t.refused} refused ({t.refused / t.cells:.1%})")


def config_of(creds: RunCredentials, identity: str) -> ServiceConfig:
    return ServiceConfig(grpc_address="127.0.0.1:0", metrics_port=-1, **creds.service_config(identity))


def generic_servicer(service: str):
    """Every method of `service` answers its empty reply: what is tested is who gets through to it."""
    desc = DESCRIPTORS[service].DESCRIPTOR.services_by_name[service]

    def method(output):
        async def call(self, request, context):
            return output()
        return call

    return type(f"Open{service}", (), {m.name: method(message_factory.GetMessageClass(m.output_type))
                                       for m in desc.methods})()


def tiny_params() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}


# gRPC


def test_every_method_is_on_the_allow_list_and_the_expected_matrix():
    listed = {f"/meshrl.v1.{svc}/{m.name}" for svc, pb in DESCRIPTORS.items()
              for m in pb.DESCRIPTOR.services_by_name[svc].methods}
    expected = {f"/meshrl.v1.{svc}/{m}": who for svc, methods in GRPC_EXPECTED.items() for m, who in methods.items()}
    assert set(expected) == listed, "the matrix covers every method of every meshrl service"
    assert {m: set(w) for m, w in POLICY.items()} == expected


async def test_grpc_matrix(creds, capsys):
    # every service's server, as a launched service runs it (its own token file, the peers' digests)
    coordinator = Coordinator(apply=None, rank_ttl=0)
    receiver = ReceiverAgent("rollout-0", tiny_params(), "127.0.0.1:1")
    servers = {}
    for service, adder in ADDERS.items():
        owner = {"RolloutService": "rollout", "RewardService": "reward", "BuilderService": "builder",
                 "TrainerService": "trainer"}[service]
        servers[service] = await start_server("127.0.0.1:0", [Servicer(adder, generic_servicer(service), f"meshrl.v1.{service}")],
                                              security=server_security(config_of(creds, owner)))
    servers["WeightExchangeService"] = await start_server(
        "127.0.0.1:0", [Servicer(wx_grpc.add_WeightExchangeServiceServicer_to_server,
                                 WeightExchangeServicer(coordinator), "meshrl.v1.WeightExchangeService")],
        security=server_security(config_of(creds, "weight_exchange")))
    servers["WeightAgentService"] = await start_server("127.0.0.1:0", [receiver.servicer()],
                                                       security=server_security(config_of(creds, "rollout")))
    callers = {"no token": None, "wrong token": secrets.token_urlsafe(32),
               **{identity: creds.token(identity) for identity in IDENTITIES}}
    try:
        for service, methods in GRPC_EXPECTED.items():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[service].port}") as ch:
                desc = DESCRIPTORS[service].DESCRIPTOR.services_by_name[service]
                for m in desc.methods:
                    request_cls = message_factory.GetMessageClass(m.input_type)
                    reply_cls = message_factory.GetMessageClass(m.output_type)
                    call = ch.unary_unary(f"/meshrl.v1.{service}/{m.name}",
                                          request_serializer=request_cls.SerializeToString,
                                          response_deserializer=reply_cls.FromString)
                    for caller, token in callers.items():
                        request = request_cls()
                        if m.name == "Apply":   # signed by the coordinator: only the token is under test here
                            request.sync_id = new_sync_id()
                            request.timeout_seconds = 5.0
                            sign_apply(receiver.key, request)
                        metadata = (("authorization", f"Bearer {token}"),) if token else None
                        try:
                            await call(request, metadata=metadata, timeout=10)
                            code = grpc.StatusCode.OK
                        except grpc.aio.AioRpcError as exc:
                            code = exc.code()
                        allowed = caller in methods[m.name]
                        where = f"{service}/{m.name} as {caller}: {code}"
                        if allowed:
                            assert code not in DENIED, where
                        elif token is None or caller == "wrong token":
                            assert code == grpc.StatusCode.UNAUTHENTICATED, where
                        else:
                            assert code == grpc.StatusCode.PERMISSION_DENIED, where
                        TALLY["grpc"].add(not allowed)
            # health and reflection stay open (grpcurl list works without a token)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[service].port}") as ch:
                from grpc_health.v1 import health_pb2, health_pb2_grpc
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for server in servers.values():
            await server.stop(0)
    report(capsys, "grpc")


# NATS


async def _connect(url: str, errors: list[str], **options):
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    return await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2,
                              error_cb=on_error, **options)


def _violated(errors: list[str], kind: str, subject: str) -> bool:
    return any(f'permissions violation for {kind} to "{subject.lower()}"' in e for e in errors)


async def test_nats_matrix(creds, tmp_path, capsys):
    server = NatsServer(tmp_path / "nats", authorization=creds.nats_authorization(),
                        config_path=creds.directory / "nats.conf", log_path=tmp_path / "nats.log")
    server.start()
    try:
        # no credentials, a wrong password, another identity's password: the connection itself is refused
        refusals = {"no credentials": {}, "wrong password": {"user": "builder", "password": "nope"},
                    "another identity's password": {"user": "builder", "password": creds.nats_password("trainer")},
                    "unknown user": {"user": "intruder", "password": creds.nats_password("trainer")}}
        for what, options in refusals.items():
            with pytest.raises((nats.errors.Error, OSError)) as err:
                nc = await _connect(server.url, [], **options)
                await nc.close()
            assert "authorization" in str(err.value).lower() or isinstance(err.value, nats.errors.NoServersError), what
            for _ in (*NATS_PUBLISH, *NATS_SUBSCRIBE):
                TALLY["nats"].add(True)
        # bootstrap the streams as meshrl does, so JetStream answers what the services are allowed to ask
        from services.common.bus import Bus
        bus = await Bus.connect(server.url, name="setup", deadline=20, **creds.bus_options("builder"))
        await bus.close()
        # every identity against every subject; the operator last (it may destroy what it is allowed to)
        for identity in (*SERVICES, OPERATOR):
            errors: list[str] = []
            nc = await _connect(server.url, errors, **creds.nats_connect_options(identity))
            try:
                for subject, allowed in NATS_SUBSCRIBE.items():
                    sub = await nc.subscribe(subject)
                    await nc.flush()
                    await asyncio.sleep(0.02)
                    ok = identity == OPERATOR or identity in allowed
                    assert _violated(errors, "subscription", subject) != ok, (identity, "subscribe", subject)
                    TALLY["nats"].add(not ok)
                    await sub.unsubscribe()
                for subject in NATS_PUBLISH:
                    if identity == OPERATOR and subject.startswith(f"{JS}.STREAM.DELETE"):
                        continue    # would delete the stream the next cells need; allowed by ">" like the rest
                    await nc.publish(subject, b"{}")
                await nc.flush()
                await asyncio.sleep(0.3)
                for subject, allowed in NATS_PUBLISH.items():
                    if identity == OPERATOR and subject.startswith(f"{JS}.STREAM.DELETE"):
                        continue
                    ok = identity == OPERATOR or identity in allowed
                    assert _violated(errors, "publish", subject) != ok, (identity, "publish", subject)
                    TALLY["nats"].add(not ok)
            finally:
                await nc.close()
    finally:
        server.stop()
    report(capsys, "nats")


# the weight plane


async def test_weight_plane_matrix(creds, capsys):
    params, into = tiny_params(), {k: torch.zeros_like(v) for k, v in tiny_params().items()}
    key, other_key = new_key(), new_key()
    server = SenderServer("trainer-0", params, key=key)
    endpoint = server.start()["tcp"]
    server.end_update(3)
    src = RankLayout("trainer-0", SENDER, "hf", hf_full_shards(params), endpoints={"tcp": endpoint})
    dst = RankLayout("rollout-0", RECEIVER, "hf", hf_full_shards(into), agent_address="-")
    transfers = plan([src], [dst]).transfers
    sync_id = new_sync_id()

    def pull(presented: str, *, sid: str = sync_id):
        return pull_all("rollout-0", into, transfers, {"trainer-0": endpoint}, "tcp", 10.0, version=3,
                        tickets={"trainer-0": presented}, sync_id=sid)

    refused_pulls = {
        "no ticket": lambda: pull(""),
        "garbage ticket": lambda: pull("00" * 32),
        "another sender's key": lambda: pull(ticket(other_key, "rollout-0", 3, sync_id)),
        "another receiver's ticket": lambda: pull(ticket(key, "rollout-1", 3, sync_id)),
        "another version's ticket": lambda: pull(ticket(key, "rollout-0", 2, sync_id)),
        "another update's ticket": lambda: pull(ticket(key, "rollout-0", 3, sync_id), sid=new_sync_id()),
    }
    try:
        for what, attempt in refused_pulls.items():
            with pytest.raises(TransportError, match="pull refused: no valid ticket"):
                await asyncio.to_thread(attempt)
                pytest.fail(f"served with {what}")
            TALLY["weight plane"].add(True)
        result = await asyncio.to_thread(pull, ticket(key, "rollout-0", 3, sync_id))
        assert result.bytes_received > 0 and all(torch.equal(into[k], params[k]) for k in params)
        TALLY["weight plane"].add(False)
    finally:
        server.stop()

    # Apply: a real receiver on a real server; the caller has the weight_exchange token, the signature is tested
    receiver = ReceiverAgent("rollout-0", tiny_params(), "127.0.0.1:1")
    rpc = await start_server("127.0.0.1:0", [receiver.servicer()], security=server_security(config_of(creds, "rollout")))
    metadata = (("authorization", f"Bearer {creds.token('weight_exchange')}"),)

    def request(**fields) -> wx_pb2.ApplyRequest:
        return wx_pb2.ApplyRequest(version=5, transport="tcp", timeout_seconds=5.0, sync_id=new_sync_id(), **fields)

    unsigned = request()
    foreign = request()
    sign_apply(other_key, foreign)
    tampered = request()
    sign_apply(receiver.key, tampered)
    tampered.sender_endpoints["trainer-0"] = "10.0.0.66:1"
    good = request()
    sign_apply(receiver.key, good)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rpc.port}") as ch:
            stub = wx_grpc.WeightAgentServiceStub(ch)
            for what, req in {"unsigned": unsigned, "signed with another key": foreign, "tampered": tampered}.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Apply(req, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
                TALLY["weight plane"].add(True)
            await stub.Apply(good, metadata=metadata, timeout=10)
            assert receiver.version == 5
            TALLY["weight plane"].add(False)
            with pytest.raises(grpc.aio.AioRpcError) as err:      # the same update again: a replay
                await stub.Apply(good, metadata=metadata, timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "replay" in err.value.details()
            TALLY["weight plane"].add(True)
    finally:
        await rpc.stop(0)

    # Register: roles by identity, and a live rank is never taken over by another identity
    coordinator = Coordinator(apply=None, rank_ttl=0)
    wx = await start_server("127.0.0.1:0", [Servicer(wx_grpc.add_WeightExchangeServiceServicer_to_server,
                                                     WeightExchangeServicer(coordinator), "meshrl.v1.WeightExchangeService")],
                            security=server_security(config_of(creds, "weight_exchange")))
    sender_layout = src.to_proto()
    receiver_layout = RankLayout("rollout-0", RECEIVER, "hf", hf_full_shards(into),
                                 agent_address="127.0.0.1:9").to_proto()
    as_ = {i: (("authorization", f"Bearer {creds.token(i)}"),) for i in IDENTITIES}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{wx.port}") as ch:
            stub = wx_grpc.WeightExchangeServiceStub(ch)
            await stub.Register(wx_pb2.RegisterRequest(layout=sender_layout, rank_key=key.hex()), metadata=as_["trainer"])
            await stub.Register(wx_pb2.RegisterRequest(layout=receiver_layout, rank_key=key.hex()),
                                metadata=as_["rollout"])
            TALLY["weight plane"].add(False)
            TALLY["weight plane"].add(False)
            denied = {"rollout registers a sender": (sender_layout, "rollout"),
                      "trainer registers a receiver": (receiver_layout, "trainer"),
                      "operator takes a sender": (sender_layout, OPERATOR),
                      "reward takes a receiver": (receiver_layout, "reward")}
            for what, (layout, identity) in denied.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Register(wx_pb2.RegisterRequest(layout=layout, rank_key=other_key.hex()),
                                        metadata=as_[identity])
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
                TALLY["weight plane"].add(True)
            # a restarted trainer (same identity, new key) replaces its own rank
            await stub.Register(wx_pb2.RegisterRequest(layout=sender_layout, rank_key=other_key.hex()),
                                metadata=as_["trainer"])
            TALLY["weight plane"].add(False)
    finally:
        await wx.stop(0)
    report(capsys, "weight plane")


# gateway: route -> who may call it. "admin": the gateway's admin key; "own": the key of the session the call acts on.
# Every other credential is refused: none, a wrong key, another plane's credential (the gRPC operator token), the
# key of a session that has ended, and (where a call acts on a session) another live session's key.
GATEWAY_MODEL_ROUTES = {("POST", "chat/completions"): {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2},
                        ("POST", "completions"): {"model": "m", "prompt": "hi", "max_tokens": 2},
                        ("POST", "responses"): {"model": "m", "input": "hi", "max_output_tokens": 2},
                        ("POST", "messages"): {"model": "m", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "hi"}]},
                        ("POST", "messages/count_tokens"): {"model": "m",
                                                            "messages": [{"role": "user", "content": "hi"}]},
                        ("GET", "models"): None, ("GET", "models/{model:path}"): None}
GATEWAY_VLLM_ROUTES = {("POST", "/tokenize"): {"prompt": "hi"}}  # vLLM's own paths, unprefixed; model-route rights
GATEWAY_ADMIN_ROUTES = {("POST", "/rl/start_session"), ("GET", "/rl/status"), ("GET", "/rl/sessions/{session_id}")}
GATEWAY_SESSION_ROUTES = {("POST", "/rl/set_reward"), ("POST", "/rl/end_session")}
GATEWAY_TOOL_ROUTES = {("POST", "/rl/run_code")}  # a session's own key only (a run belongs to an episode)
GATEWAY_LABEL_ROUTES = {("POST", "/rl/set_preference")}  # a person's label: the admin key only, never an agent's
GATEWAY_OPEN_ROUTES = {("GET", "/health"), ("GET", "/healthz")}


def test_gateway_matrix(creds, capsys):
    from services.reward.client import RewardClient
    from tests.gateway.harness import ADMIN, GatewayServer, RewardServer
    from tests.gateway.policies import calculator_replies, scripted_engine, tokenizer

    tok = tokenizer()
    reward = RewardServer().start()
    gw = GatewayServer(scripted_engine(tok, calculator_replies), tok, reward=RewardClient(reward.address)).start()
    try:
        model_routes = {(m, f"{prefix}/{path}"): body for (m, path), body in GATEWAY_MODEL_ROUTES.items()
                        for prefix in ("/v1", "")} | GATEWAY_VLLM_ROUTES
        served = {(m, r.path) for r in gw.app.routes for m in r.methods if m != "HEAD"}
        assert served == {*model_routes, *GATEWAY_ADMIN_ROUTES, *GATEWAY_SESSION_ROUTES, *GATEWAY_TOOL_ROUTES,
                          *GATEWAY_LABEL_ROUTES, *GATEWAY_OPEN_ROUTES}, \
            "a gateway route without a row in the matrix"
        ended = gw.start_session()
        assert gw.session_post(ended["api_key"], "/rl/end_session").status_code == 200

        def call(method: str, path: str, key: str | None, body: dict | None) -> int:
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            r = httpx.request(method, gw.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code < 300 or r.status_code in (401, 403, 409), (method, path, r.status_code, r.text)
            return r.status_code

        def check(method: str, path: str, credential: str, key: str | None, body: dict | None, allowed: bool):
            status = call(method, path, key, body)
            assert (status < 300) == allowed, (method, path, credential, status)
            TALLY["gateway"].add(not allowed)

        refused_always = {"none": None, "wrong": "sk-" + secrets.token_hex(16), "another plane's": creds.token(OPERATOR),
                          "an ended session's": ended["api_key"]}
        for (method, path), body in model_routes.items():
            path = path.replace("{model:path}", gw.config.model_name)
            for credential, key in refused_always.items():
                check(method, path, credential, key, body, False)
            check(method, path, "admin", ADMIN, body, True)
            check(method, path, "own", gw.start_session()["api_key"], body, True)
        for method, path in sorted(GATEWAY_ADMIN_ROUTES):
            live = gw.start_session()
            path = path.replace("{session_id}", live["session_id"])
            body = {"task_id": "t"} if method == "POST" else None
            for credential, key in {**refused_always, "a live session's": live["api_key"]}.items():
                check(method, path, credential, key, body, False)
            check(method, path, "admin", ADMIN, body, True)
        def with_a_call(session: dict) -> dict:  # a reward needs a model call to land on
            chat = GATEWAY_MODEL_ROUTES[("POST", "chat/completions")]
            assert call("POST", "/v1/chat/completions", session["api_key"], chat) == 200
            return session

        for method, path in sorted(GATEWAY_LABEL_ROUTES):
            pair = [with_a_call(s) for s in gw.start_session(group_size=2)["sessions"]]
            body = {"chosen": pair[0]["session_id"], "rejected": pair[1]["session_id"]}
            for credential, key in {**refused_always, "a live session's": pair[0]["api_key"]}.items():
                check(method, path, credential, key, body, False)
            check(method, path, "admin", ADMIN, body, True)

        for method, path in sorted(GATEWAY_SESSION_ROUTES):
            extra = {"reward": 1.0} if path.endswith("reward") else {}

            def body(target: dict, extra: dict = extra) -> dict:
                return {"session_id": target["session_id"], **extra}

            target = with_a_call(gw.start_session())
            for credential, key in {**refused_always, "another session's": gw.start_session()["api_key"]}.items():
                check(method, path, credential, key, body(target), False)
            assert gw.session_info(target["session_id"])["state"] == "active", "a refused call changed the session"
            check(method, path, "admin", ADMIN, body(target), True)
            own = with_a_call(gw.start_session())
            check(method, path, "own", own["api_key"], body(own), True)
        for method, path in sorted(GATEWAY_TOOL_ROUTES):
            for credential, key in {**refused_always, "admin": ADMIN}.items():
                check(method, path, credential, key, {"code": "print(1)"}, False)
            check(method, path, "own", gw.start_session()["api_key"], {"code": "print(1)"}, True)
        for method, path in sorted(GATEWAY_OPEN_ROUTES):
            assert call(method, path, None, None) == 200
    finally:
        gw.stop()
        reward.stop()
    report(capsys, "gateway")


def test_matrix_totals(capsys):
    cells = sum(t.cells for t in TALLY.values())
    refused = sum(t.refused for t in TALLY.values())
    if not cells:
        pytest.skip("run with the matrix tests")
    with capsys.disabled():
        print(f"\nauth matrix total: {cells} cells ({', '.join(f'{k} {t.cells}' for k, t in TALLY.items())}), "
              f"{refused} refused ({refused / cells:.1%}), the rest allowed as designed")
