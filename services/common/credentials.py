"""A run's credentials, generated once under `<run_dir>/secrets` (directory 0700, files 0600) and read back by
every (re)started process, plus the NATS users and subject permissions of each identity.

Files: `grpc-<identity>.token` (bearer token), `grpc-peers.json` (identity -> SHA-256 of its token: what servers
check against; no secret in it), `nats-<identity>.password`, `nats-route.password` (cluster routes),
`gateway_admin_key` (the agent gateway's admin key). `write_grant` copies one identity's share of them (`grant_files`)
where only that identity's containers look (Compose: a volume each). Secrets are never logged or written into the services' config files: those carry the paths.

NATS permissions (`nats_permissions`) follow what each service really does; what stays shared is listed in
`SHARED_BY_DESIGN`.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets

from services.common.auth import IDENTITIES, OPERATOR, SERVICES, read_secret, token_digest
from services.common.bus import CONSUMERS, STREAMS, inbox_for
from services.common.errors import FieldError

ROUTE_USER = "route"
GATEWAY_ADMIN_KEY = "gateway_admin_key"  # services.rollout.gateway.config.ADMIN_KEY_FILE's name
KV_STREAM = "KV_meshrl_builder"      # services.builder.ledger.BUCKET
OBJ_STREAM = "OBJ_BATCH_BLOBS"       # services.common.batches.BLOBS
IMAGES_STREAM = "OBJ_IMAGES"         # services.common.images.BUCKET
JS = "$JS.API"
LEASE_PREFIX = "meshrl_lease_"       # services.common.lease.bucket_name
LEASED = ("builder", "weight_exchange")  # the single-active services: each takes its own lease

SHARED_BY_DESIGN = (
    "events.version is one subject for trained, checkpoint, eval, run-end, budget and deployed events: trainer, "
    "builder and weight_exchange may all publish it (the kinds are not separated by subject)",
    "every service declares every stream at start (services.common.bus.Bus.ensure), so each may create meshrl's "
    "five streams; a durable consumer is created or updated only by the service that consumes it "
    "(subject permissions cannot enforce settings, so no service may rewrite another's durable)",
    "stream info and the $JS.API.INFO account summary are readable by every service",
)


def _write_secret(path: pathlib.Path, value: str) -> None:
    """Create `path` with mode 0600 (never replacing an existing file: a restarted process reads the same)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


class RunCredentials:
    """The secrets of one run in `directory`; `ensure` creates what is missing and keeps what exists."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = pathlib.Path(directory)

    @classmethod
    def ensure(cls, directory: pathlib.Path) -> RunCredentials:
        creds = cls(directory)
        creds.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(creds.directory, 0o700)
        for identity in IDENTITIES:
            for path in (creds.token_file(identity), creds.nats_password_file(identity)):
                if not path.exists():
                    _write_secret(path, secrets.token_urlsafe(32))
        if not creds.nats_password_file(ROUTE_USER).exists():
            _write_secret(creds.nats_password_file(ROUTE_USER), secrets.token_urlsafe(32))
        if not creds.gateway_admin_key_file.exists():  # the path the rollout's gateway reads under <run_dir>/secrets
            _write_secret(creds.gateway_admin_key_file, "sk-meshrl-admin-" + secrets.token_urlsafe(32))
        peers = json.dumps({i: token_digest(creds.token(i)) for i in IDENTITIES}, indent=1)
        if not creds.peers_file.exists() or creds.peers_file.read_text() != peers:
            tmp = creds.peers_file.with_name(f".{creds.peers_file.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            _write_secret(tmp, peers)
            os.replace(tmp, creds.peers_file)
        return creds

    # files

    def token_file(self, identity: str) -> pathlib.Path:
        return self.directory / f"grpc-{identity}.token"

    @property
    def peers_file(self) -> pathlib.Path:
        return self.directory / "grpc-peers.json"

    @property
    def gateway_admin_key_file(self) -> pathlib.Path:
        return self.directory / GATEWAY_ADMIN_KEY

    def nats_password_file(self, user: str) -> pathlib.Path:
        return self.directory / f"nats-{user}.password"

    def token(self, identity: str) -> str:
        return read_secret(self.token_file(identity))

    def nats_password(self, user: str) -> str:
        return read_secret(self.nats_password_file(user))

    # what processes get

    def service_config(self, identity: str) -> dict:
        """The config fields that give a service its credentials (paths only)."""
        return {"auth_token_file": str(self.token_file(identity)), "auth_peers_file": str(self.peers_file),
                "nats_user": identity, "nats_password_file": str(self.nats_password_file(identity))}

    def nats_connect_options(self, identity: str = OPERATOR) -> dict:
        """Keyword arguments for `nats.connect` as `identity` (the launcher's own clients use the operator)."""
        options = {"user": identity, "password": self.nats_password(identity)}
        if identity != OPERATOR:
            options["inbox_prefix"] = inbox_for(identity)
        return options

    def bus_options(self, identity: str = OPERATOR) -> dict:
        """Keyword arguments for `Bus.connect` as `identity`."""
        return {"user": identity, "password": self.nats_password(identity)}

    def nats_authorization(self) -> dict:
        """The nats-server `authorization` block: one user per identity with its permissions."""
        users = [{"user": i, "password": self.nats_password(i), "permissions": nats_permissions(i)}
                 for i in IDENTITIES]
        return {"users": users}

    def route_credentials(self) -> tuple[str, str]:
        return ROUTE_USER, self.nats_password(ROUTE_USER)


def _stream_names() -> list[str]:
    return [s.name for s in STREAMS]


def _follow(stream: str) -> list[str]:
    """An ephemeral pull consumer on `stream` (services.common.bus.follow): create, fetch, delete."""
    return [f"{JS}.CONSUMER.CREATE.{stream}", f"{JS}.CONSUMER.CREATE.{stream}.>", f"{JS}.CONSUMER.MSG.NEXT.{stream}.*",
            f"{JS}.CONSUMER.DELETE.{stream}.*", f"{JS}.CONSUMER.INFO.{stream}.*"]


def _consume(durable: str) -> list[str]:
    """Pull from a durable consumer (services.common.bus.consume): bind, fetch, ack / nak / in-progress / term."""
    stream = CONSUMERS[durable].stream
    return [f"{JS}.CONSUMER.INFO.{stream}.{durable}", f"{JS}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>"]


def _own_durable(identity: str) -> list[str]:
    """Create-or-update of the durable named after `identity`, if it has one: the legacy durable-create API updates
    a differing config (filter, ack_wait, max_ack_pending), so it is granted for one's own consumer only
    (services.common.bus.declared_consumers declares no other)."""
    spec = CONSUMERS.get(identity)
    return [f"{JS}.CONSUMER.DURABLE.CREATE.{spec.stream}.{spec.durable}"] if spec else []


def _ordered_reader(stream: str) -> list[str]:
    """An ordered push consumer (key-value keys, object-store reads): create, flow control, delete, direct gets."""
    return [*_follow(stream), f"$JS.FC.{stream}.>", f"{JS}.STREAM.MSG.GET.{stream}", f"{JS}.DIRECT.GET.{stream}",
            f"{JS}.DIRECT.GET.{stream}.>", f"{JS}.STREAM.INFO.{stream}"]


def _lease(service: str) -> list[str]:
    """The service's own lease bucket (services.common.lease): create it, read, create / renew / delete the key."""
    stream = f"KV_{LEASE_PREFIX}{service}"
    return [f"$KV.{LEASE_PREFIX}{service}.>", f"{JS}.STREAM.CREATE.{stream}", *_ordered_reader(stream)]


def nats_permissions(identity: str) -> dict:
    """The nats-server permissions of `identity`: publish (data subjects and JetStream API) and subscribe."""
    if identity == OPERATOR:
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if identity not in SERVICES:
        raise FieldError("identity", f"unknown {identity!r}")
    streams = _stream_names()
    pub = [f"{JS}.INFO", *(f"{JS}.STREAM.CREATE.{s}" for s in streams), *(f"{JS}.STREAM.INFO.{s}" for s in streams),
           *_own_durable(identity)]
    sub = [f"{inbox_for(identity)}.>"]
    dlq = f"dlq.{identity}"
    if identity == "builder":
        # traj.scored: a preference dataset's pairs, scored by the builder itself (dataset.preference)
        pub += ["prompts.>", "traj.scored", "batches.>", "events.version", dlq, "$KV.meshrl_builder.>", "$O.BATCH_BLOBS.>",
                *(f"{JS}.STREAM.UPDATE.{s}" for s in streams), f"{JS}.STREAM.NAMES", f"{JS}.STREAM.MSG.GET.BATCHES",
                f"{JS}.DIRECT.GET.BATCHES", f"{JS}.DIRECT.GET.BATCHES.>",
                f"{JS}.STREAM.CREATE.{KV_STREAM}", f"{JS}.STREAM.CREATE.{OBJ_STREAM}",
                f"{JS}.STREAM.PURGE.{OBJ_STREAM}", *_ordered_reader(KV_STREAM), *_ordered_reader(OBJ_STREAM),
                "$O.IMAGES.>", f"{JS}.STREAM.CREATE.{IMAGES_STREAM}", *_ordered_reader(IMAGES_STREAM),
                *_consume("builder"), *_follow("EVENTS"), *_follow("DLQ")]
    elif identity == "trainer":
        pub += ["events.version", dlq, f"{JS}.STREAM.NAMES", f"{JS}.STREAM.MSG.GET.BATCHES", f"{JS}.DIRECT.GET.BATCHES",
                f"{JS}.DIRECT.GET.BATCHES.>", *_ordered_reader(OBJ_STREAM), *_ordered_reader(IMAGES_STREAM)]
        sub += ["batches.train.*"]     # the wake-up when the next batch is published (services.common.batches)
    elif identity == "rollout":
        # IMAGES: the work's images are read; an agent session's (the gateway) are written at its export
        pub += ["traj.raw", "traj.scored", dlq, *_consume("rollout"), *_follow("EVENTS"), f"{JS}.STREAM.NAMES",
                "$O.IMAGES.>", f"{JS}.STREAM.CREATE.{IMAGES_STREAM}", *_ordered_reader(IMAGES_STREAM)]
    elif identity == "reward":
        pub += ["traj.scored", dlq, *_consume("reward")]
    elif identity == "weight_exchange":
        pub += ["events.version"]
    if identity in LEASED:
        pub += _lease(identity)
    return {"publish": {"allow": pub}, "subscribe": {"allow": sub}}


def grant_files(creds: RunCredentials, identity: str) -> list[pathlib.Path]:
    """The files a process running as `identity` needs, and nothing of another identity's: its gRPC token and NATS
    password, the peers' digests, and for the rollout the agent gateway's admin key."""
    if identity not in IDENTITIES:
        raise FieldError("grant", f"unknown identity {identity!r} (one of {', '.join(IDENTITIES)})")
    files = [creds.token_file(identity), creds.nats_password_file(identity), creds.peers_file]
    return [*files, creds.gateway_admin_key_file] if identity == "rollout" else files


def write_grant(creds: RunCredentials, identity: str, directory: pathlib.Path) -> None:
    """Copy `identity`'s files (grant_files) into `directory` (a volume only that identity's containers mount),
    each replaced atomically, so a container restarting meanwhile reads the old copy or the new, never a part;
    files there that are not granted (e.g. from an older layout) are removed."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    granted = grant_files(creds, identity)
    for source in granted:
        tmp = directory / f".{source.name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(source.read_bytes())
        os.replace(tmp, directory / source.name)
    for stale in set(directory.iterdir()) - {directory / f.name for f in granted}:
        if stale.is_file():
            stale.unlink()


def _parse_grant(text: str) -> tuple[str, pathlib.Path]:
    identity, sep, directory = text.partition("=")
    if not sep or not identity or not directory:
        raise ValueError(f"--grant: {text!r} is not IDENTITY=DIR")
    if identity not in IDENTITIES:
        raise ValueError(f"--grant: unknown identity {identity!r} (one of {', '.join(IDENTITIES)})")
    return identity, pathlib.Path(directory)


def _write_fragment(path: pathlib.Path, text: str) -> None:
    """Write a nats-server config fragment holding passwords (mode 0600, atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    _write_secret(tmp, text)
    os.replace(tmp, path)


def write_nats_include(creds: RunCredentials, path: pathlib.Path) -> None:
    """The `authorization` block as a nats-server config fragment (mode 0600) for `include` in a nats.conf."""
    _write_fragment(path, "authorization: " + json.dumps(creds.nats_authorization(), indent=1))


def route_urls(creds: RunCredentials, routes: list[str]) -> list[str]:
    """The cluster's route URLs with the route user's credentials (what every node dials)."""
    user, password = creds.route_credentials()
    out = []
    for route in routes:
        scheme, sep, rest = route.partition("://")
        if not sep or not rest or "@" in rest:
            raise FieldError("nats_routes", f"{route!r} is not a nats-route://host:port URL without credentials")
        out.append(f"{scheme}://{user}:{password}@{rest}")
    return out


def write_nats_cluster_include(creds: RunCredentials, path: pathlib.Path, routes: list[str]) -> None:
    """What goes inside a nats.conf `cluster { }` block: the routes' authorization and the route URLs with their
    credentials (the password cannot be referenced from the public part of the configuration)."""
    user, password = creds.route_credentials()
    _write_fragment(path, "authorization: " + json.dumps({"user": user, "password": password}) + "\n"
                    "routes: " + json.dumps(route_urls(creds, routes), indent=1))


def main(argv: list[str] | None = None) -> int:
    """`python -m services.common.credentials DIR [--nats-include FILE] [--nats-cluster-include FILE --nats-routes
    URL,...]`: generate (or keep) a run's credentials in DIR and optionally write the nats-server users with their
    permissions (and a cluster's route authorization) for deployments; prints no secret."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m services.common.credentials", description=main.__doc__)
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--nats-include", type=pathlib.Path, help="write the nats-server authorization block here")
    parser.add_argument("--nats-cluster-include", type=pathlib.Path,
                        help="write the inside of a cluster block (route authorization and routes) here")
    parser.add_argument("--nats-routes", default="", help="comma-separated nats-route://host:port of every node")
    parser.add_argument("--grant", action="append", default=[], metavar="IDENTITY=DIR",
                        help="copy only IDENTITY's files (its token and NATS password, the peers' digests, the "
                        "rollout's gateway admin key) into DIR; repeatable")
    args = parser.parse_args(argv)
    routes = [r.strip() for r in args.nats_routes.split(",") if r.strip()]
    if bool(args.nats_cluster_include) != bool(routes):
        parser.error("--nats-cluster-include and --nats-routes go together")
    try:
        grants = [_parse_grant(g) for g in args.grant]
    except ValueError as exc:
        parser.error(str(exc))
    creds = RunCredentials.ensure(args.directory)
    written: dict[str, object] = {}
    if args.nats_include:
        write_nats_include(creds, args.nats_include)
        written["nats_include"] = str(args.nats_include)
    if args.nats_cluster_include:
        write_nats_cluster_include(creds, args.nats_cluster_include, routes)
        written["nats_cluster_include"] = str(args.nats_cluster_include)
    for identity, directory in grants:
        write_grant(creds, identity, directory)
    if grants:
        written["grants"] = {identity: str(directory) for identity, directory in grants}
    print(json.dumps({"directory": str(creds.directory), "identities": list(IDENTITIES),
                      "peers_file": str(creds.peers_file), **written}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
