"""deploy/k8s: every overlay renders with `kubectl kustomize`, every object validates offline (kubernetes-validate
--strict), and the objects are the design's (replication, probes, scaling, budgets, policies, secrets, settings)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from services.builder.config import BuilderConfig
from services.common.config import load_config
from services.common.credentials import LEASED
from services.common.lease import BUCKET_BYTES
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig
from services.weight_exchange.config import WeightExchangeConfig

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.name for p in (ROOT / "deploy" / "k8s" / "overlays").iterdir() if p.is_dir())
SERVICES = {"weight_exchange": WeightExchangeConfig, "reward": RewardConfig, "builder": BuilderConfig,
            "trainer": TrainerConfig, "rollout": RolloutConfig}
WORKLOADS = {"weight-exchange": "Deployment", "reward": "Deployment", "builder": "Deployment",
             "trainer": "StatefulSet", "rollout": "Deployment"}
METRICS_PORT = 9090
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
PORTS = {"rollout": 50051, "reward": 50052, "builder": 50053, "trainer": 50054, "weight-exchange": 50055}
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # oldest supported (gRPC probes GA: 1.27), newest


@pytest.fixture(scope="module")
def k8s_tree(tmp_path_factory) -> pathlib.Path:
    """deploy/k8s copied aside with the dev overlay's credentials generated as the docs say (git ignores them)."""
    tree = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(ROOT / "deploy" / "k8s", tree, ignore=shutil.ignore_patterns("credentials"))
    creds = tree / "overlays" / "dev" / "credentials"
    subprocess.run([sys.executable, "-m", "services.common.credentials", str(creds), "--nats-include",
                    str(creds / "nats-auth.conf")], check=True, capture_output=True, cwd=ROOT, timeout=120)
    return tree


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, k8s_tree) -> tuple[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(k8s_tree / "overlays" / request.param)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return request.param, [d for d in yaml.safe_load_all(out) if d]


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def test_every_object_validates_strictly(rendered):
    _, objects = rendered
    assert objects
    for version in K8S_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_workloads_have_probes_resources_and_a_non_root_user(rendered):
    _, objects = rendered
    for name, kind in WORKLOADS.items():
        pod = find(objects, kind, name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == PORTS[name], (name, probe)
        assert container["resources"]["requests"] and container["resources"]["limits"], name
        assert container["args"] == [name.replace("-", "_")]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_singletons_recreate_and_trainer_ranks_are_a_statefulset_behind_a_headless_service(rendered):
    _, objects = rendered
    for name in ("builder", "weight-exchange"):
        deployment = find(objects, "Deployment", name)
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    trainer = find(objects, "StatefulSet", "trainer")
    service = find(objects, "Service", trainer["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    volumes = {v["name"]: v for v in trainer["spec"]["template"]["spec"]["volumes"]}
    find(objects, "PersistentVolumeClaim", volumes["checkpoints"]["persistentVolumeClaim"]["claimName"])


def test_a_trainer_rank_group_runs_in_one_pod_with_its_settings_and_shared_memory(rendered):
    """components/trainer-ranks: the settings make a valid megatron rank group (the entrypoint starts that many
    ranks with torchrun in the pod); gloo / NCCL get a /dev/shm larger than the container default."""
    overlay, objects = rendered
    (run,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("meshrl-run")]
    env = run["data"]
    trainer = find(objects, "StatefulSet", "trainer")
    if overlay != "dev-megatron":
        assert env.get("MESHRL_TRAINER__RANKS", "1") == "1"
        return
    config = load_config(TrainerConfig, "trainer", env={k: v for k, v in env.items() if k.startswith("MESHRL_TRAINER__")})
    assert (config.backend, config.ranks, config.megatron.tp, config.shard_sync) == ("megatron", 2, 2, True)
    assert trainer["spec"]["replicas"] == 1   # one pod per rank group
    pod = trainer["spec"]["template"]["spec"]
    shm = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_each_pod_mounts_only_its_own_credentials(rendered):
    """No secret travels in the environment; each service's pod gets its own token and NATS password (and the peers'
    digests), the NATS pod only the users' configuration, from the Secret meshrl-credentials."""
    overlay, objects = rendered
    secret_names = set()
    for name, kind in {**WORKLOADS, "nats": "StatefulSet"}.items():
        pod = find(objects, kind, name)["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], name
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        secret_names.add(volume["secret"]["secretName"])
        items = {i["key"] for i in volume["secret"]["items"]}
        if name == "nats":
            assert items == ({"nats-auth.conf", "nats-cluster.conf"} if overlay.startswith("prod") else
                             {"nats-auth.conf"})
            continue
        identity = name.replace("-", "_")
        expected = {f"grpc-{identity}.token", "grpc-peers.json", f"nats-{identity}.password"}
        assert items == expected | ({"gateway_admin_key"} if name == "rollout" else set()), name
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[volume["name"]]["mountPath"] == "/secrets" and mounts[volume["name"]]["readOnly"] is True
    secrets = [o for o in objects if o["kind"] == "Secret"]
    if overlay.startswith("dev"):  # generated from the files made beforehand; elsewhere created beforehand
        (secret,) = secrets
        assert secret_names == {secret["metadata"]["name"]}
        assert {"grpc-operator.token", "grpc-peers.json", "nats-auth.conf", "gateway_admin_key"} <= set(secret["data"])
    else:
        assert not secrets and secret_names == {"meshrl-credentials"}


def test_settings_are_valid_service_configs(rendered):
    """The ConfigMap every service reads (envFrom) loads into each service's typed config without an error."""
    overlay, objects = rendered
    (run,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("meshrl-run")]
    env = dict(run["data"])
    for service, cls in SERVICES.items():
        config = load_config(cls, service, env=env)
        assert config.nats_replicas == (3 if overlay.startswith("prod") else 1), service
        assert config.nats_user == service and config.auth_token_file == f"/secrets/grpc-{service}.token"
        assert config.auth_peers_file == "/secrets/grpc-peers.json"
        assert len(config.nats_url.split(",")) == (3 if overlay.startswith("prod") else 1), service
        # Prometheus scrapes from another pod (the metrics NetworkPolicy): loopback would be unreachable
        assert (config.metrics_address, config.metrics_port) == ("0.0.0.0", METRICS_PORT), service
    assert load_config(TrainerConfig, "trainer", env=env).weight_transport == "tcp"


def test_nats_is_a_jetstream_cluster_of_three_in_prod(rendered):
    overlay, objects = rendered
    nats = find(objects, "StatefulSet", "nats")
    (conf,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("nats-config")]
    text = conf["data"]["nats.conf"]
    settings = "\n".join(line.split("#")[0] for line in text.splitlines())  # without the comments
    assert "jetstream" in text and "include ./auth/nats-auth.conf" in text and "password" not in settings
    if overlay.startswith("prod"):
        assert nats["spec"]["replicas"] == 3 and "include ./auth/nats-cluster.conf" in text
        assert all(f"nats-{i}.nats-headless:6222" in text for i in range(3))  # the command that generates the routes
    else:
        assert nats["spec"]["replicas"] == 1 and "cluster" not in settings


def test_the_streams_budget_fits_the_nats_store_and_the_store_fits_its_volume(rendered):
    """Every service's nats_max_bytes is reserved on each NATS node when the streams are declared: over the
    server's max_file_store the services could not start."""
    _, objects = rendered
    (conf,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("nats-config")]
    (store,) = re.findall(r"^jetstream \{.*max_file_store: (\d+)", conf["data"]["nats.conf"], re.MULTILINE)
    (claim,) = find(objects, "StatefulSet", "nats")["spec"]["volumeClaimTemplates"]
    volume = claim["spec"]["resources"]["requests"]["storage"]
    assert volume.endswith("Gi")
    assert int(store) <= int(volume.removesuffix("Gi")) << 30
    (run,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("meshrl-run")]
    for service, cls in SERVICES.items():
        budget = load_config(cls, service, env=dict(run["data"])).nats_max_bytes
        leases = len(LEASED) * BUCKET_BYTES  # outside the budget, reserved too
        assert 0 < budget and budget + leases <= int(store), service


def test_prod_scales_rollout_and_reward_with_budgets_and_accelerators(rendered):
    overlay, objects = rendered
    hpas = {o["spec"]["scaleTargetRef"]["name"] for o in objects if o["kind"] == "HorizontalPodAutoscaler"}
    pdbs = {o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    if not overlay.startswith("prod"):
        assert not hpas and not pdbs
        return
    assert hpas == {"rollout", "reward"} and pdbs == {"nats", "rollout", "reward"}
    accelerator = "huawei.com/Ascend910" if overlay == "prod-ascend" else "nvidia.com/gpu"
    for kind, name in (("StatefulSet", "trainer"), ("Deployment", "rollout")):
        pod = find(objects, kind, name)["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"][accelerator] == "1" and pod["nodeSelector"], name


def test_network_policies_deny_by_default_and_open_the_design_flows(rendered):
    _, objects = rendered
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}

    def sources(name: str) -> set[str]:
        return {peer["podSelector"]["matchLabels"].get("app.kubernetes.io/name", "")
                for rule in policies[name]["ingress"] for peer in rule.get("from", []) if "podSelector" in peer}

    assert sources("weight-exchange") == {"trainer", "rollout"}
    assert "weight-exchange" in sources("rollout")
    assert sources("trainer") == {"rollout"}
    labels = {o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/part-of")
              for o in objects if o["kind"] in ("Deployment", "StatefulSet")}
    assert labels == {"meshrl"}  # what the NATS policy admits


def test_metrics_and_nats_monitoring_are_open_to_the_monitoring_namespace_only(rendered):
    """Every ingress rule that opens the services' metrics port or NATS's monitoring port (8222: /connz, /jsz
    disclose users, connections and consumer configs without authentication) admits only the monitoring
    namespace; no rule opens a port to every source."""
    _, objects = rendered
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    opened = {}
    for name, spec in policies.items():
        for rule in spec.get("ingress", []):
            assert rule.get("from"), f"{name}: an ingress rule open to every source"
            for port in rule.get("ports", []):
                opened.setdefault(port["port"], []).append((name, rule["from"]))
    assert opened[8222] == [("nats", [MONITORING])]
    assert opened[METRICS_PORT] == [("metrics", [MONITORING])]


@pytest.mark.parametrize("overlay", ["base", "overlays/prod"])
def test_nats_configuration_with_generated_credentials_is_valid(tmp_path, overlay):
    """The nats.conf each overlay ships, with the includes `python -m services.common.credentials` writes, is what a
    real nats-server accepts (`-t` checks the configuration)."""
    from launcher.processes import nats_server_binary

    shutil.copy(ROOT / "deploy" / "k8s" / overlay / "nats.conf", tmp_path / "nats.conf")
    auth = tmp_path / "auth"
    routes = ",".join(f"nats-route://nats-{i}.nats-headless:6222" for i in range(3))
    subprocess.run([sys.executable, "-m", "services.common.credentials", str(auth), "--nats-include",
                    str(auth / "nats-auth.conf"), "--nats-cluster-include", str(auth / "nats-cluster.conf"),
                    "--nats-routes", routes], check=True, capture_output=True, cwd=ROOT, timeout=120)
    out = subprocess.run([nats_server_binary(), "-c", str(tmp_path / "nats.conf"), "-t"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, "POD_NAME": "nats-0"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "route:" in (auth / "nats-cluster.conf").read_text() and oct((auth / "nats-auth.conf").stat().st_mode)[-3:] == "600"


def test_only_the_reward_pod_may_build_the_code_sandbox(rendered):
    """F10(c): the reward container runs without the runtime's seccomp and AppArmor profiles and with an unmasked
    /proc (bubblewrap needs unshare, mount and a fresh /proc), inside a user namespace of its own; no other workload
    relaxes anything."""
    _, objects = rendered
    for name, kind in WORKLOADS.items():
        template = find(objects, kind, name)["spec"]["template"]
        pod = template["spec"]
        (container,) = pod["containers"]
        context = container["securityContext"]
        annotations = template["metadata"].get("annotations") or {}
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        if name == "reward":
            assert pod["hostUsers"] is False
            assert context["seccompProfile"]["type"] == "Unconfined" and context["procMount"] == "Unmasked"
            assert annotations == {"container.apparmor.security.beta.kubernetes.io/reward": "unconfined"}
        else:
            assert "seccompProfile" not in context and "procMount" not in context and "hostUsers" not in pod, name
            assert not any("apparmor" in key for key in annotations), name
        assert context["capabilities"]["drop"] == ["ALL"] and not context.get("privileged"), name
