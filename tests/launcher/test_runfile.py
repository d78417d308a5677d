"""The run file is the user's: every value the launcher puts into a service's config is a default that the file
can set (it stands), or the stack's wiring, which a file that sets it is told about (the field named)."""

from __future__ import annotations

import pytest
import yaml

from launcher.runfile import UP_DEFAULTS, fill, up_plan
from launcher.stack import ROOT, UP_CONFIG, Stack, load_plan, random_ports


@pytest.fixture
def stack(tmp_path):
    return Stack(tmp_path / "run", random_ports())


def config(stack: Stack, service: str, plan: dict, *, seed: int = 5, detach: bool = False, algo: str = "") -> dict:
    plan = {"services": {"builder": {}, **plan.pop("services", {})}, **plan}
    return stack.service_config(service, plan, seed=seed, model_path=ROOT / "model", algo=algo, detach=detach)


def get(cfg: dict, path: str):
    for key in path.split("."):
        cfg = cfg[key]
    return cfg


# (service, dotted key in its section, the file's value, the launcher's default, run-file extras, config options)
OVERRIDES = [
    ("rollout", "metrics_port", 9100, None, {}, {"detach": True}),      # up: the service's port + 1000
    ("trainer", "metrics_port", 9100, 0, {}, {}),
    ("rollout", "engine.seed", 7, 5, {}, {}),
    ("builder", "seed", 7, 5, {}, {}),
    ("trainer", "seed", 7, 5, {}, {}),
    ("rollout", "engine.dtype", "float32", "bfloat16", {"dtype": "bfloat16"}, {}),
    ("trainer", "dtype", "float32", "bfloat16", {"dtype": "bfloat16"}, {}),
    ("rollout", "engine.device", "cpu", "cpu", {"device": "cpu"}, {}),
    ("trainer", "max_new_tokens", 4, 16, {"services": {"builder": {"sampling": {"max_new_tokens": 16}}}}, {}),
    ("trainer", "total_steps", 3, 9, {"services": {"builder": {"total_steps": 9}}}, {}),
    ("builder", "dataset", {"kind": "mine"}, {"kind": "top"}, {"dataset": {"kind": "top"}}, {}),
    ("builder", "dynamic_sampling", False, True, {"services": {"trainer": {"algo": "grpo", "algo_overrides":
                                                                          {"dynamic_sampling": True}}}}, {}),
]


def nest(path: str, value) -> dict:
    *outer, last = path.split(".")
    out: dict = {last: value}
    for key in reversed(outer):
        out = {key: out}
    return out


def merged(extra: dict, service: str, section: dict) -> dict:
    plan = yaml.safe_load(yaml.safe_dump(extra))  # a copy
    services = plan.setdefault("services", {})
    services[service] = fill(section, services.get(service) or {})
    return plan


@pytest.mark.parametrize("service, key, mine, default, extra, options", OVERRIDES,
                         ids=[f"{o[0]}.{o[1]}" for o in OVERRIDES])
def test_each_launcher_value_is_a_default_the_file_can_set(stack, service, key, mine, default, extra, options):
    left_unset = config(stack, service, merged(extra, service, {}), **options)
    expected = stack.ports[service] + 1000 if default is None else default
    assert get(left_unset, key) == expected, f"file leaves {key} unset: the launcher's default"
    set_by_file = config(stack, service, merged(extra, service, nest(key, mine)), **options)
    assert get(set_by_file, key) == mine, f"file sets {key}: it stands"


def test_cluster_mode_replicas_are_a_default_too(tmp_path):
    stack = Stack(tmp_path / "run", random_ports(), nats_mode="cluster")
    assert config(stack, "builder", {})["nats_replicas"] == 3
    assert config(stack, "builder", {"services": {"builder": {"nats_replicas": 1}}})["nats_replicas"] == 1


def test_a_file_that_sets_some_engine_settings_keeps_them_and_gets_the_rest(stack):
    cfg = config(stack, "rollout", {"services": {"rollout": {"engine": {"max_batch": 8, "max_context": 8192}}}})
    assert cfg["engine"]["max_batch"] == 8 and cfg["engine"]["max_context"] == 8192
    assert cfg["engine"]["seed"] == 5 and cfg["engine"]["model_path"] == str(ROOT / "model")


def test_the_command_lines_algo_is_the_one_setting_over_the_files(stack):
    plan = {"services": {"trainer": {"algo": "grpo", "algo_overrides": {"dynamic_sampling": True}}}}
    assert config(stack, "trainer", plan)["algo"] == "grpo"
    chosen = config(stack, "trainer", plan, algo="dapo")
    assert chosen["algo"] == "dapo" and "algo_overrides" not in chosen


@pytest.mark.parametrize("service, section, field", [
    ("rollout", {"grpc_address": "0.0.0.0:1"}, "services.rollout.grpc_address"),
    ("trainer", {"nats_url": "nats://elsewhere:4222"}, "services.trainer.nats_url"),
    ("builder", {"model_path": "/models/x"}, "services.builder.model_path"),
    ("reward", {"run_dir": "/tmp/x"}, "services.reward.run_dir"),
    ("trainer", {"auth_token_file": "/tmp/t"}, "services.trainer.auth_token_file"),
    ("rollout", {"engine": {"model_path": "/models/x"}}, "services.rollout.engine.model_path"),
    ("rollout", {"gateway": {"port": 9000}}, "services.rollout.gateway.port"),
])
def test_the_stacks_wiring_in_the_file_is_refused_naming_the_field(stack, service, section, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        config(stack, service, {"services": {service: section}})


# make up

UP_KEYS = [("builder", "total_steps", 40), ("trainer", "total_steps", 40), ("trainer", "optim.schedule", "linear"),
           ("rollout", "gateway_enabled", False), ("rollout", "engine.max_context", 8192)]


@pytest.mark.parametrize("service, key, mine", UP_KEYS, ids=[f"{k[0]}.{k[1]}" for k in UP_KEYS])
def test_up_fills_in_only_what_the_file_leaves_unset(stack, service, key, mine):
    default = get(UP_DEFAULTS[service], key)
    left_unset = up_plan({"services": {"builder": {}}})
    assert get(config(stack, service, left_unset), key) == default
    set_by_file = up_plan({"services": {"builder": {}, **{service: nest(key, mine)}}})
    assert get(config(stack, service, set_by_file), key) == mine


def test_up_keeps_the_files_max_context_the_reported_case(tmp_path, stack):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"services": {"rollout": {"engine": {"max_context": 8192}}}}))
    cfg = config(stack, "rollout", up_plan(load_plan(str(path))))
    assert cfg["engine"]["max_context"] == 8192 and cfg["gateway_enabled"] is True


def test_up_without_a_file_runs_the_main_jobs_settings_unbounded(stack):
    plan = up_plan(load_plan(UP_CONFIG), force=True)
    assert load_plan(UP_CONFIG)["services"]["builder"]["total_steps"] > 0
    assert plan["services"]["builder"]["total_steps"] == 0 and plan["services"]["trainer"]["total_steps"] == 0
    assert plan["services"]["trainer"]["optim"]["schedule"] == "constant"
    assert plan["services"]["trainer"]["optim"]["lr"] == load_plan(UP_CONFIG)["services"]["trainer"]["optim"]["lr"]
    assert plan["services"]["rollout"]["gateway_enabled"] is True
