"""The run file is one typed RunConfig: an unknown key anywhere is refused with its path; every value the launcher
puts into a service's config is a default the file can set (it stands), a setting owned by one service that the
others follow (a section that contradicts it is refused), or the stack's wiring, which a file that sets it is told
about (the field named)."""

from __future__ import annotations

import pytest
import yaml

from launcher.agents import temperature_env
from launcher.runconfig import RunConfig
from launcher.runfile import UP_DEFAULTS, fill
from launcher.stack import ROOT, UP_CONFIG, Stack, random_ports
from services.common.config import config_values


@pytest.fixture
def stack(tmp_path):
    return Stack(tmp_path / "run", random_ports())


def config(stack: Stack, service: str, plan: dict | RunConfig, *, seed: int = 5, detach: bool = False,
           algo: str = "") -> dict:
    run = plan if isinstance(plan, RunConfig) else RunConfig.from_dict(plan)
    derived = stack.derive(run, seed=seed, model_path=ROOT / "model", algo=algo, detach=detach)
    return derived.values(service)


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
    assert chosen["algo"] == "dapo" and chosen["algo_overrides"] == {}
    # the builder refills for the preset the command line chose
    assert config(stack, "builder", plan, algo="dapo")["dynamic_sampling"] is True
    assert config(stack, "builder", plan, algo="drgrpo")["dynamic_sampling"] is False


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

UP_KEYS = [("builder", "total_steps", 40), ("trainer", "optim.schedule", "linear"),
           ("rollout", "gateway_enabled", False), ("rollout", "engine.max_context", 8192)]


@pytest.mark.parametrize("service, key, mine", UP_KEYS, ids=[f"{k[0]}.{k[1]}" for k in UP_KEYS])
def test_up_fills_in_only_what_the_file_leaves_unset(stack, service, key, mine):
    default = get(UP_DEFAULTS[service], key)
    left_unset = RunConfig.from_dict({}).unbounded()
    assert get(config(stack, service, left_unset), key) == default
    set_by_file = RunConfig.from_dict({"services": {service: nest(key, mine)}}).unbounded()
    assert get(config(stack, service, set_by_file), key) == mine


def test_up_keeps_the_files_max_context_the_reported_case(tmp_path, stack):
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"services": {"rollout": {"engine": {"max_context": 8192}}}}))
    cfg = config(stack, "rollout", RunConfig.load(str(path), root=ROOT).unbounded())
    assert cfg["engine"]["max_context"] == 8192 and cfg["gateway_enabled"] is True


def test_up_without_a_file_runs_the_main_jobs_settings_unbounded(stack):
    main = RunConfig.load(UP_CONFIG, root=ROOT)
    up = main.unbounded(force=True)
    assert main.services.builder["total_steps"] > 0
    trainer = config(stack, "trainer", up)
    assert config(stack, "builder", up)["total_steps"] == 0 and trainer["total_steps"] == 0
    assert trainer["optim"]["schedule"] == "constant"
    assert trainer["optim"]["lr"] == main.services.trainer["optim"]["lr"]
    assert config(stack, "rollout", up)["gateway_enabled"] is True


# one typed home: mistakes named by their path, cross-service settings owned once

@pytest.mark.parametrize("plan, field", [
    ({"datset": {}}, "datset"),
    ({"dataset": {"promt_field": "q"}}, "dataset.promt_field"),
    ({"services": {"builer": {}}}, "services.builer"),
    ({"services": {"builder": {"sampling": {"temprature": 0.7}}}}, "services.builder.sampling.temprature"),
    ({"services": {"trainer": {"optim": {"lrr": 1e-6}}}}, "services.trainer.optim.lrr"),
    ({"services": {"rollout": {"engine": {"max_batchh": 8}}}}, "services.rollout.engine.max_batchh"),
    ({"timeout_seconds": "soon"}, "timeout_seconds"),
])
def test_a_misspelt_or_ill_typed_key_anywhere_is_refused_naming_its_path(stack, plan, field):
    with pytest.raises(ValueError, match=f"^{field.replace('.', chr(92) + '.')}: "):
        config(stack, "builder", plan)


@pytest.mark.parametrize("owner, follower, value", [
    ("total_steps", "total_steps", 9),
    ("sampling.max_new_tokens", "max_new_tokens", 16),
    ("sampling.temperature", "temperature", 0.7),
])
def test_the_trainer_follows_the_builders_sampling_and_length_and_a_contradiction_is_refused(stack, owner, follower,
                                                                                             value):
    plan = {"services": {"builder": nest(owner, value)}}
    assert config(stack, "trainer", plan)[follower] == value
    agreeing = {"services": {"builder": nest(owner, value), "trainer": {follower: value}}}
    assert config(stack, "trainer", agreeing)[follower] == value
    contradicting = {"services": {"builder": nest(owner, value), "trainer": {follower: value * 2}}}
    with pytest.raises(ValueError, match=f"^services\\.trainer\\.{follower}: .* differs from "
                                         f"services\\.builder\\.{owner.replace('.', chr(92) + '.')}"):
        config(stack, "trainer", contradicting)


def test_the_top_level_dataset_is_the_builders_and_setting_it_twice_is_refused(stack):
    dataset = {"family": "basic_arithmetic", "verifier": "exact"}
    assert config(stack, "builder", {"dataset": dataset})["dataset"]["family"] == "basic_arithmetic"
    with pytest.raises(ValueError, match=r"^services\.builder\.dataset: "):
        config(stack, "builder", {"dataset": dataset, "services": {"builder": {"dataset": dataset}}})


def test_the_staleness_bound_is_the_builders_default_where_the_file_leaves_it_unset(stack):
    """The report and the chaos audit read eta from the derived plan, not from the file with their own default."""
    from services.builder.config import BuilderConfig

    derived = stack.derive(RunConfig.from_dict({}), seed=0, model_path=ROOT / "model")
    assert derived.eta == BuilderConfig().max_staleness == 1


def test_a_users_hugging_face_model_gets_pretrained_defaults_and_a_built_in_one_keeps_the_services(stack, tmp_path):
    from services.trainer.optim import OptimConfig

    mine = RunConfig.from_dict({"model": str(tmp_path / "my-model")})
    assert mine.pretrained
    derived = stack.derive(mine, seed=0, model_path=tmp_path / "my-model")
    assert derived.trainer.optim.lr == 1e-6 and derived.trainer.optim.grad_clip == 1.0
    assert "pretrained defaults" in derived.describe() and "lr 1e-06" in derived.describe()
    chosen = RunConfig.from_dict({"model": str(tmp_path / "my-model"),
                                  "services": {"trainer": {"optim": {"lr": 3e-5}}}})
    assert stack.derive(chosen, seed=0, model_path=tmp_path).trainer.optim.lr == 3e-5    # the file's stands
    built_in = stack.derive(RunConfig.from_dict({"model": "tiny-qwen3"}), seed=0, model_path=tmp_path)
    assert built_in.trainer.optim.lr == OptimConfig().lr


def test_run_and_up_derive_the_same_configs_from_a_file_that_sets_ups_keys(stack):
    """`up` differs from `run` only by UP_DEFAULTS where the file leaves them unset, and its metrics ports."""
    plan = RunConfig.load("configs/run.yaml", root=ROOT)
    plan = plan.replace(**{s: fill(plan.services.of(s), {**UP_DEFAULTS[s], "metrics_port": 9100})
                           for s in ("builder", "trainer", "rollout")})
    for service in ("reward", "weight_exchange"):
        plan = plan.replace(**{service: {**plan.services.of(service), "metrics_port": 9100}})
    run = stack.derive(plan, seed=0, model_path=ROOT / "model").files()
    up = stack.derive(plan.unbounded(), seed=0, model_path=ROOT / "model", detach=True).files()
    assert run == up


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_run_file_derives_configs_the_services_load_back_unchanged(stack, tmp_path, path):
    """What the launcher writes (every setting) is what each service loads from the file it is given."""
    from launcher.runconfig import config_class
    from services.common.config import load_config

    derived = stack.derive(RunConfig.load(path, root=ROOT), seed=0, model_path=ROOT / "model")
    for service, values in derived.files().items():
        file = tmp_path / f"{service}.yaml"
        file.write_text(yaml.safe_dump(values))
        loaded = load_config(config_class(service), service, path=file, env={})
        assert config_values(loaded) == values, service


def test_a_preference_dataset_needs_a_pairwise_preset(stack, tmp_path):
    rows = tmp_path / "prefs.jsonl"
    rows.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    dataset = {"train": str(rows), "eval": str(rows), "preference": True}
    with pytest.raises(ValueError, match="^services.trainer.algo: the dataset's rows are preference pairs"):
        config(stack, "builder", {"dataset": dataset})
    assert config(stack, "builder", {"dataset": dataset, "services": {"trainer": {"algo": "dpo"}}})["dataset"][
        "preference"] is True


def test_the_settings_line_names_whose_lengths_an_online_run_uses(stack):
    """An agent run's completion lengths are its agents' --max-tokens: the line does not print the builder's unused
    default; a dataset run prints its own, and both print the temperature the trainer computes at."""
    agents = stack.derive(RunConfig.from_dict({"services": {"builder": {"source": "online",
                                                                        "sampling": {"temperature": 0.7}}}}),
                          seed=0, model_path=ROOT / "model").describe()
    assert "max_new_tokens the agents" in agents and "temperature 0.7" in agents
    dataset = stack.derive(RunConfig.from_dict({"services": {"builder": {"sampling": {"max_new_tokens": 12}}}}),
                           seed=0, model_path=ROOT / "model").describe()
    assert "max_new_tokens 12," in dataset


def test_the_agents_temperature_is_the_builders_set_once(stack):
    """The launcher hands the agents the builder's temperature; an agent argument naming another is refused by
    field (the trainer would skip every batch as sampled at another temperature), the same one is accepted."""
    def derive(agents, agent_args):
        run = RunConfig.from_dict({"agents": agents, "agent_args": agent_args,
                                   "services": {"builder": {"source": "online", "sampling": {"temperature": 0.7}}}})
        return stack.derive(run, seed=0, model_path=ROOT / "model")

    with pytest.raises(ValueError, match=r"^agent_args: --temperature 1 differs from services.builder.sampling."
                                         r"temperature \(0.7\)"):
        derive(["code_agent.py"], ["--temperature", "1.0"])
    with pytest.raises(ValueError, match=r"^agents\[1\]: --temperature 0.5 differs"):
        derive(["code_agent.py", "search_agent.py --temperature=0.5"], [])
    with pytest.raises(ValueError, match=r"^agent_args: --temperature: must be a number, got 'hot'"):
        derive(["code_agent.py"], ["--temperature", "hot"])
    assert derive(["code_agent.py --temperature 0.7"], ["--episodes", "4"]).configs["builder"].sampling.temperature \
        == 0.7
    assert temperature_env(0.7) == {"MESHRL_TEMPERATURE": "0.7"} and temperature_env(1.0) == {}
