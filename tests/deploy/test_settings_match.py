"""The Compose file's and the k8s ConfigMap's settings are what `RunConfig` derives from configs/run.yaml: every
setting of every service equal, apart from where the deployment wires things (addresses, credentials, folders,
the model's path, metrics). A setting changed in the run file and not in a deployment, or a cross-service setting
set by hand in one (dynamic sampling), fails here naming the service and the key."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from launcher.runconfig import SERVICES, RunConfig, config_class
from services.common.config import config_values, load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
# what a deployment sets from its own wiring, not from the run file
WIRING = {"nats_url", "nats_replicas", "grpc_address", "metrics_port", "metrics_address", "run_dir", "model_path",
          "auth_token", "auth_token_file", "auth_peers_file", "nats_user", "nats_password", "nats_password_file",
          "nats_creds_file", "tls_cert_file", "tls_key_file", "tls_ca_file", "tls_client_auth", "tls_server_name",
          "wx_address", "reward_address", "weight_transport", "weight_host", "rank_id", "engine.model_path"}
COMPOSE_NAMES = {"weight_exchange": "weight-exchange"}


def flat(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and value and key not in ("algo_overrides",):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def settings(values: dict) -> dict:
    return {k: v for k, v in flat(values).items() if k not in WIRING and not k.startswith("gateway.")}


def compose_env(service: str) -> dict[str, str]:
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "docker-compose.yml").read_text())
    env = compose["services"][COMPOSE_NAMES.get(service, service)]["environment"]
    # Compose's ${VAR:-default} with the defaults (what `docker compose up` runs without a .env file)
    return {k: re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: m[2] or "", str(v)) for k, v in env.items()}


def k8s_env() -> dict[str, str]:
    lines = (ROOT / "deploy" / "k8s" / "base" / "run.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


@pytest.fixture(scope="module")
def derived() -> dict[str, dict]:
    plan = RunConfig.load("configs/run.yaml", root=ROOT).derive(seed=0)
    return {service: settings(plan.values(service)) for service in SERVICES}


@pytest.mark.parametrize("deployment", ["compose", "k8s"])
@pytest.mark.parametrize("service", SERVICES)
def test_a_deployments_settings_equal_what_the_run_config_derives(derived, deployment, service):
    env = compose_env(service) if deployment == "compose" else k8s_env()
    deployed = settings(config_values(load_config(config_class(service), service, env=env)))
    differ = {k: (deployed.get(k), derived[service].get(k)) for k in deployed.keys() | derived[service].keys()
              if deployed.get(k) != derived[service].get(k)}
    assert not differ, f"{deployment} {service}: (deployed, derived) differ: {differ}"
