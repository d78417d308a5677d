"""Typed service configuration: dataclass defaults, then a YAML file, then environment overrides.

Environment keys look like `MESHRL_<SERVICE>__<KEY>` (nested: `MESHRL_TRAINER__ALGO__EPS_CLIP`).
Values are parsed as YAML scalars/lists, then checked against the field type; an unknown or
ill-typed key raises `ConfigError` naming it, which stops start-up.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml

from services.common.errors import FieldError, field_error

T = TypeVar("T")

DEFAULT_MAX_BYTES = 4 << 30  # the data plane's byte budget on the JetStream server, over every capped stream


MIN_LEASE_SECONDS = 3.0  # a single-active service's lease (services.common.lease): renewed every third of it


def check_lease_seconds(seconds: float) -> float:
    if not seconds >= MIN_LEASE_SECONDS:
        raise FieldError("lease_seconds", f"must be >= {MIN_LEASE_SECONDS}, got {seconds!r}")
    return float(seconds)


class ConfigError(FieldError):
    """A configuration key is unknown or has the wrong type (or its config's own check refused it)."""


@dataclasses.dataclass(kw_only=True)
class ServiceConfig:
    """Settings every service has."""

    nats_url: str = "nats://127.0.0.1:4222"  # several servers (a cluster): comma-separated
    nats_replicas: int = 1                    # stream replication; 3 on a three-node JetStream cluster
    nats_max_bytes: int = (DEFAULT_MAX_BYTES  # bytes TRAJ 30%, BATCHES 45%, batch blobs 15%, EVENTS, DLQ 4% each,
                           )  # builder ledger 2% may keep on the server, reserved there (must fit its max_file_store); -1: no caps
    grpc_address: str = "127.0.0.1:0"
    metrics_port: int = 0  # 0: pick a free port; -1: no metrics endpoint
    metrics_address: str = "127.0.0.1"  # the IP /metrics listens on; 0.0.0.0 in containers, for Prometheus to scrape
    log_level: str = "info"
    run_dir: str = "runs/default"
    # gRPC security (services.common.auth). Secrets live in files (0600), never in this config or the logs.
    auth_token: str = ""            # this service's bearer token; alone (no peers file): one token shared by all
    auth_token_file: str = ""       # a file holding this service's token (what the launcher writes)
    auth_peers_file: str = ""       # identity -> sha256 of its token; with it, each method has an allow-list
    grpc_reflection: bool = True    # reflection (and health) answer without a token
    tls_cert_file: str = ""         # PEM: this service's certificate (server, and client with mTLS)
    tls_key_file: str = ""
    tls_ca_file: str = ""           # PEM: the CA that signed the peers' certificates (clients check servers)
    tls_client_auth: bool = False   # mTLS: servers require a client certificate signed by tls_ca_file
    tls_server_name: str = ""       # the name clients expect in servers' certificates (default: the host)
    # NATS credentials: a user and its password (or password file), or an nkeys/JWT credentials file
    nats_user: str = ""
    nats_password: str = ""
    nats_password_file: str = ""
    nats_creds_file: str = ""


def load_config(cls: type[T], service: str, *, path: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None) -> T:
    """Build `cls` from defaults, the YAML file at `path` (or `MESHRL_<SERVICE>_CONFIG`), env and overrides."""
    env = os.environ if env is None else env
    prefix = f"MESHRL_{service.upper()}__"
    path = path or env.get(f"MESHRL_{service.upper()}_CONFIG")
    values: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(pathlib.Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(str(path), "top level must be a mapping")
        _merge(values, loaded)
    for key, raw in env.items():
        if key.startswith(prefix):
            parts = [p.lower() for p in key[len(prefix):].split("__")]
            _merge(values, _nest(parts, yaml.safe_load(raw) if raw != "" else ""))
    if overrides:
        _merge(values, dict(overrides))
    return _build(cls, values, service)


def _nest(parts: list[str], value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(parts):
        out = {part: out}
    return out


def _merge(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = dict(value) if isinstance(value, Mapping) else value


def build_config(cls: type[T], values: Mapping[str, Any], where: str = "") -> T:
    """`cls` from a mapping of settings; ConfigError naming the key path below `where` ("" at the top level)."""
    if not isinstance(values, Mapping):
        raise ConfigError(where or "config", f"expected a mapping, got {values!r}")
    return _build(cls, values, where)


def config_values(config: Any) -> dict[str, Any]:
    """The settings of a config dataclass as plain data (what `build_config` takes back): every init field,
    nested configs as mappings, tuples as lists."""
    return {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config) if f.init}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_values(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _build(cls: type[T], values: Mapping[str, Any], where: str) -> T:
    assert dataclasses.is_dataclass(cls), cls
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(_path(where, key), f"unknown key (known: {', '.join(sorted(fields))})")
        kwargs[key] = _coerce(hints[key], value, _path(where, key))
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:
        raise _within(where, exc) from exc


def _within(where: str, exc: ValueError) -> ConfigError:
    """A config's own check ("algo: unknown preset ...") named from the top: "services.trainer.algo: ..."; a
    ValueError that names no field is the problem of the config at ``where``."""
    found = field_error(exc)
    inner = found.within(where) if found is not None else FieldError(where, str(exc))
    return ConfigError(inner.field, inner.problem)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(where, f"expected a mapping, got {value!r}")
        return _build(hint, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if errors else ConfigError(where, f"bad value {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(where, f"expected one of {typing.get_args(hint)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(where, f"expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(where, f"expected a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(where, f"expected true/false, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(where, f"expected a number, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(where, f"expected an integer, got {value!r}")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(where, f"expected a string, got {value!r}")
    raise ConfigError(where, f"unsupported type {hint!r}")
