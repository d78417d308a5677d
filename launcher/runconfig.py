"""The run file as one typed object, and the one function that derives the five service configs from it.

`RunConfig` is what `configs/*.yaml` holds: the model, the run-wide settings and one section per service. Loading it
refuses an unknown key anywhere with the key's path (`datset: unknown key`, `services.builder.datset: ...`).
`RunConfig.derive` owns every setting that more than one service needs, once:

- run-wide settings the file sets at the top (`dtype`, `device`, `dataset`) and the run's seed go to each service
  that needs them, as defaults a section may still set (`runfile.fill`);
- settings one service owns and another must agree with are taken from the owner, and a section that sets them
  differently is refused naming both fields: the trainer's `total_steps`, `max_new_tokens` and `temperature` are
  the builder's (`total_steps`, `sampling.max_new_tokens`, `sampling.temperature`); the builder's
  `dynamic_sampling` is the trainer's preset's (unless the builder section sets it);
- a Hugging Face model the user names gets the trainer settings that are safe for a pretrained model
  (`PRETRAINED_DEFAULTS`) where the file leaves them unset; the built-in tiny models keep the service defaults;
- the stack's wiring (addresses, credentials, folders, the model directory) comes from the caller, and a file that
  sets one is refused (`runfile.check_wiring`).

`run`, `up`, `chaos`, the report, the eval script and the benchmarks all load the file through here, so they
derive the same service configs from the same file (no I/O here beyond reading the file in `load`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import pathlib
from typing import Any

import yaml

from launcher.runfile import UP_DEFAULTS, WIRING, check_wiring, fill
from services.common.config import ConfigError, build_config, config_values
from services.common.errors import FieldError

SERVICES = ("weight_exchange", "reward", "builder", "trainer", "rollout")
CONFIG_CLASSES = {"builder": "services.builder.config:BuilderConfig",
                  "reward": "services.reward.config:RewardConfig",
                  "rollout": "services.rollout.config:RolloutConfig",
                  "trainer": "services.trainer.config:TrainerConfig",
                  "weight_exchange": "services.weight_exchange.config:WeightExchangeConfig"}
BUILT_IN_MODELS = ("tiny-qwen3", "tiny-qwen3-chat", "tiny-qwen3-tools", "tiny-qwen3-code", "tiny-qwen3-search",
                   "tiny-qwen3-moe", "tiny-vlm")
DTYPES = ("float32", "bfloat16")

# A pretrained model's trainer settings where the file leaves them unset, in line with TRL's GRPOConfig and verl's
# actor defaults (learning rate 1e-6, gradient clipping at 1.0, no warm-up). The service defaults (lr 1e-4) are
# the built-in 0.4M-parameter models': on SmolLM2-135M they took held-out accuracy from 0.81 to 0.31 in 4 steps.
PRETRAINED_DEFAULTS = {"trainer": {"optim": {"lr": 1e-6, "grad_clip": 1.0, "warmup_updates": 0}}}

# (owner's field, follower's field): the follower's value is the owner's; a section that sets it otherwise is refused
ONE_SOURCE = [(("builder", "total_steps"), ("trainer", "total_steps")),
              (("builder", "sampling.max_new_tokens"), ("trainer", "max_new_tokens")),
              (("builder", "sampling.temperature"), ("trainer", "temperature"))]


def config_class(service: str) -> type:
    module, name = CONFIG_CLASSES[service].split(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(kw_only=True)
class Sections:
    """`services:`, one mapping per service: checked against the service's own config when derived."""

    builder: dict[str, Any] = dataclasses.field(default_factory=dict)
    reward: dict[str, Any] = dataclasses.field(default_factory=dict)
    rollout: dict[str, Any] = dataclasses.field(default_factory=dict)
    trainer: dict[str, Any] = dataclasses.field(default_factory=dict)
    weight_exchange: dict[str, Any] = dataclasses.field(default_factory=dict)

    def of(self, service: str) -> dict[str, Any]:
        return getattr(self, service)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    model: str = "tiny-qwen3"            # a built-in name or a Hugging Face model directory
    dtype: str = "float32"               # the engine's weights and the trainer's compute
    device: str = ""                     # the engine's and the trainer's ("": each one's default, cpu)
    dataset: dict[str, Any] | None = None  # the builder's `dataset` (services.builder.dataset.DatasetConfig)
    timeout_seconds: float = 900.0       # the whole run
    startup_timeout_seconds: float = 300.0  # until every service serves (a real model loads slowly)
    # examples/agents scripts driven through the gateway, each optionally with its own arguments ("x.py --task y")
    agents: list[str] = dataclasses.field(default_factory=list)
    agent_args: list[str] = dataclasses.field(default_factory=list)
    # models served frozen beside the stack for the agents (launcher/frozen.py): name -> FrozenModel's keys
    frozen_models: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # MoE routing replay (R3): the engine records the experts each token was routed to, the trainer's forwards
    # use them (rollout engine.record_routes + trainer routing_replay)
    routing_replay: bool = False
    services: Sections = dataclasses.field(default_factory=Sections)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device:
            from services.common.device import check_device

            check_device(self.device)
        for i, entry in enumerate(self.agents):
            from launcher.agents import agent_command

            try:
                agent_command(entry)
            except ValueError as exc:
                raise FieldError(f"agents[{i}]", str(exc)) from None
        if self.frozen_models:
            from launcher.frozen import FrozenModel, check_names

            if not isinstance(self.frozen_models, dict):
                raise FieldError("frozen_models", "must be a map: name -> {model: ..., max_context: ...}")
            check_names(self.frozen_models)
            for name, spec in self.frozen_models.items():
                build_config(FrozenModel, spec, f"frozen_models.{name}")
        reference = self.services.trainer.get("reference") if isinstance(self.services.trainer, dict) else None
        served = reference.get("served") if isinstance(reference, dict) else None
        if served and served not in self.frozen_models:
            raise FieldError("services.trainer.reference.served", f"{served!r} is not one of the run's frozen_models "
                             f"({', '.join(self.frozen_models) or 'none'})")
        if self.timeout_seconds <= 0 or self.startup_timeout_seconds <= 0:
            raise ValueError("timeout_seconds / startup_timeout_seconds: must be > 0")
        if self.dataset is not None:
            from services.builder.datasets.config import DatasetConfig

            build_config(DatasetConfig, self.dataset, "dataset")   # a mistake names `dataset.<key>` now

    @property
    def pretrained(self) -> bool:
        """The user's own Hugging Face model (not a built-in tiny one)."""
        return self.model not in BUILT_IN_MODELS

    # loading

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        """ConfigError naming the key path for an unknown key or a bad value."""
        return build_config(cls, values, "")

    @classmethod
    def load(cls, config: str | os.PathLike, *, root: pathlib.Path) -> RunConfig:
        """A run file (relative: from the working directory, else `root`). Dataset files named relative to the
        working directory are made absolute (the services run in the repository)."""
        path = pathlib.Path(config).expanduser()
        if not path.is_absolute() and not path.exists():
            path = root / path
        if not path.is_file():
            raise FieldError("config", f"no such file {str(config)!r}")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise FieldError("config", f"{config} is not a mapping of settings")
        dataset = values.get("dataset")
        if isinstance(dataset, dict):
            for key in ("train", "eval"):
                value = dataset.get(key)
                if isinstance(value, str) and value and not os.path.isabs(value) and os.path.exists(value):
                    dataset[key] = os.path.abspath(value)
        try:
            return cls.from_dict(values)
        except ConfigError as exc:
            raise ConfigError(exc.field, f"{exc.problem} (in {path})") from None

    def to_dict(self) -> dict[str, Any]:
        return config_values(self)

    def replace(self, **sections: dict[str, Any]) -> RunConfig:
        """A copy with the named service sections replaced."""
        return dataclasses.replace(self, services=dataclasses.replace(self.services, **copy.deepcopy(sections)))

    def unbounded(self, *, force: bool = False) -> RunConfig:
        """What `make up` runs: `runfile.UP_DEFAULTS` (unbounded, the agent gateway, a context for agent prompts)
        where the file leaves them unset; `force`: over the file's values (for the built-in default file, written
        for `make run`'s bounded job)."""
        out = {}
        for service, defaults in UP_DEFAULTS.items():
            section = self.services.of(service)
            out[service] = fill(defaults, section) if force else fill(section, defaults)
        return self.replace(**out)

    # deriving

    def derive(self, *, seed: int, algo: str = "", wiring: dict[str, dict] | None = None,
               launcher: dict[str, dict] | None = None) -> RunPlan:
        """The five service configs, typed. `wiring`: per service, what the stack sets (refused in the file);
        `launcher`: per service, the stack's own defaults (metrics ports, replicas); `algo`: --algo, the one
        setting the command line changes over the file's (the profile's `algo_overrides` go with the old preset)."""
        wiring, launcher = wiring or {}, launcher or {}
        sections = {s: copy.deepcopy(self.services.of(s)) for s in SERVICES}
        if algo and algo != sections["trainer"].get("algo", "grpo"):
            sections["trainer"]["algo"] = algo
            sections["trainer"].pop("algo_overrides", None)
        for service in SERVICES:
            check_wiring(service, sections[service], [k for k in wiring.get(service, {}) if k in WIRING])
        if self.dataset is not None and sections["builder"].get("dataset") is not None:
            raise ConfigError("services.builder.dataset", "the run's dataset is the top-level `dataset`; "
                              "set it there only")
        values = {}
        for service in SERVICES:
            defaults = fill(launcher.get(service), self._defaults(service, seed))
            if self.pretrained:
                defaults = fill(PRETRAINED_DEFAULTS.get(service), defaults)
            values[service] = fill(sections[service], defaults)
            for key, value in wiring.get(service, {}).items():
                if isinstance(value, dict):
                    values[service][key] = {**(values[service].get(key) or {}), **value}
                else:
                    values[service][key] = value
        if sections["builder"].get("dynamic_sampling") is None:
            values["builder"]["dynamic_sampling"] = self._dynamic_sampling(values["trainer"])
        configs: dict[str, Any] = {"builder": build_config(config_class("builder"), values["builder"], "services.builder")}
        builder = config_values(configs["builder"])
        for (owner, owner_key), (follower, key) in ONE_SOURCE:
            value, mine = _get(builder, owner_key), _get(sections[follower], key)
            if mine is not None and mine != value:
                raise ConfigError(f"services.{follower}.{key}", f"{mine!r} differs from services.{owner}.{owner_key} "
                                  f"({value!r}); it is set once, as services.{owner}.{owner_key}")
            _set(values[follower], key, value)
        self._check_agent_temperature(configs["builder"].sampling.temperature)
        configs.update({s: build_config(config_class(s), values[s], f"services.{s}") for s in SERVICES
                        if s != "builder"})
        configs["rollout"] = _adapter_sync(configs["trainer"], configs["rollout"], sections["rollout"])
        if configs["builder"].dataset.preference and configs["trainer"].algorithm_config().objective != "dpo":
            raise ConfigError("services.trainer.algo", f"the dataset's rows are preference pairs (dataset.preference): "
                              f"they train a pairwise preset (dpo), not {configs['trainer'].algo!r}")
        if configs["builder"].source == "online" and not configs["builder"].max_trajectory_tokens:
            # an agent's trajectory holds up to the engine's context: what the builder's TRAJ capacity check counts
            configs["builder"] = dataclasses.replace(configs["builder"],
                                                     max_trajectory_tokens=configs["rollout"].engine.max_context)
        return RunPlan(run=self, configs=configs, seed=seed)

    def _defaults(self, service: str, seed: int) -> dict[str, Any]:
        """The run-wide settings as a service's defaults (a section that sets one keeps its value)."""
        device = {"device": self.device} if self.device else {}
        replay = {"routing_replay": True} if self.routing_replay else {}
        if service == "rollout":
            return {"engine": {"seed": seed, "dtype": self.dtype, **device,
                               **({"record_routes": True} if replay else {})}}
        if service == "trainer":
            return {"seed": seed, "dtype": self.dtype, **device, **replay}
        if service == "builder":
            return {"seed": seed, **({"dataset": self.dataset} if self.dataset is not None else {})}
        return {}

    def _check_agent_temperature(self, temperature: float) -> None:
        """The agents sample at the builder's temperature (the launcher passes it to them, and the trainer's
        log-probs are at it): an agent argument that says otherwise would have every batch skipped as sampled at
        another temperature."""
        import shlex

        from launcher.agents import sent_temperature

        sources = [("agent_args", [str(a) for a in self.agent_args]),
                   *((f"agents[{i}]", shlex.split(entry)[1:]) for i, entry in enumerate(self.agents))]
        for field, args in sources:
            try:
                sent = sent_temperature(args)
            except ValueError as exc:
                raise ConfigError(field, str(exc)) from None
            if sent is not None and sent != temperature:
                raise ConfigError(field, f"--temperature {sent:g} differs from services.builder.sampling.temperature "
                                         f"({temperature:g}); it is set once, there (the agents are given it)")

    @staticmethod
    def _dynamic_sampling(trainer: dict[str, Any]) -> bool:
        """The builder filters and refills for the trainer's dynamic sampling (its preset's setting)."""
        from services.trainer.algorithms.presets import dynamic_sampling  # imports torch: only when deriving

        return dynamic_sampling(trainer.get("algo", "grpo"), trainer.get("algo_overrides") or {})


def _adapter_sync(trainer: Any, rollout: Any, section: dict[str, Any]) -> Any:
    """`trainer.lora.sync: adapter`: the engine takes the adapters, with the trainer's r, alpha and targets (set
    once, in the trainer's section)."""
    lora = trainer.lora
    if not (lora.enabled and lora.sync == "adapter"):
        return rollout
    if (section.get("engine") or {}).get("lora"):
        raise ConfigError("services.rollout.engine.lora", "follows services.trainer.lora (sync: adapter); "
                          "set r, alpha and target_modules there only")
    from services.rollout.engines.lora_merge import AdapterConfig

    adapters = AdapterConfig(r=lora.r, alpha=lora.alpha, target_modules=list(lora.target_modules))
    try:
        return dataclasses.replace(rollout, engine=dataclasses.replace(rollout.engine, lora=adapters))
    except ValueError as exc:
        raise ConfigError("services.trainer.lora.sync", str(exc)) from None


@dataclasses.dataclass
class RunPlan:
    """What a run file derives: each service's typed config."""

    run: RunConfig
    configs: dict[str, Any]
    seed: int

    def values(self, service: str) -> dict[str, Any]:
        """The service's config as the file the service loads (every field: the effective settings)."""
        return config_values(self.configs[service])

    def files(self) -> dict[str, dict[str, Any]]:
        """What `Stack.start` writes: each service's `values`."""
        return {service: self.values(service) for service in SERVICES}

    @property
    def builder(self) -> Any:
        return self.configs["builder"]

    @property
    def trainer(self) -> Any:
        return self.configs["trainer"]

    @property
    def eta(self) -> int:
        return self.builder.max_staleness

    @property
    def total_steps(self) -> int:
        return self.builder.total_steps

    def describe(self) -> str:
        """One line of the effective run-wide settings (`meshrl run` prints it before starting)."""
        run, trainer, builder = self.run, self.trainer, self.builder
        kind = "a Hugging Face model: pretrained defaults" if run.pretrained else "built-in"
        parts = [f"model {run.model} ({kind})", f"dtype {run.dtype}", f"device {trainer.device}",
                 f"seed {self.seed}", f"algo {trainer.algo}", f"lr {trainer.optim.lr:g}",
                 f"total_steps {builder.total_steps or 'unbounded'}", f"eta {builder.max_staleness}",
                 f"batch {builder.batch_size}x{builder.group_size}",
                 f"temperature {builder.sampling.temperature:g}",
                 # an online run's prompts and lengths are its agents' (their max_tokens), not the builder's
                 f"max_new_tokens {builder.sampling.max_new_tokens if builder.source != 'online' else 'the agents'}",
                 f"dynamic_sampling {'on' if builder.dynamic_sampling else 'off'}",
                 f"engine {self.configs['rollout'].engine.kind}",
                 f"gateway {'on' if self.configs['rollout'].gateway_enabled else 'off'}"]
        return "meshrl: effective settings: " + ", ".join(parts)


def _get(values: dict[str, Any], path: str) -> Any:
    found: Any = values
    for key in path.split("."):
        if not isinstance(found, dict):
            return None
        found = found.get(key)
    return found


def _set(values: dict[str, Any], path: str, value: Any) -> None:
    *outer, last = path.split(".")
    for key in outer:
        values = values.setdefault(key, {})
    values[last] = value
