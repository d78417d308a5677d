"""Every service's config checked before anything starts, the way the service itself will load it: a config
error stops the launcher with one line naming the field, instead of a service that exits while starting.

The builder's dataset gets one step more: file rows are read (a bad row names its file, line and field) and
every verifier the tasks name must be one the reward service answers to, with options it accepts."""

from __future__ import annotations

import pathlib
from typing import Any

from launcher.runconfig import config_class
from services.common.config import load_config

GENERATED_SOURCES = ("arithmetic", "reasoning_gym")  # generated at start-up from checked options: nothing to read


class PreflightError(ValueError):
    """A run config the services would refuse; the message is one line naming the setting."""


def check_service(service: str, config_file: pathlib.Path) -> Any:
    """The service's config as the service will load it (environment overrides included)."""
    try:
        return load_config(config_class(service), service, path=config_file)
    except ValueError as exc:
        raise PreflightError(f"services.{exc}") from None  # load_config names the field from the service down


def check_dataset(builder_config: Any) -> dict[str, int]:
    """Reads a file dataset's rows and checks their verifiers; returns the row count of each split."""
    from services.builder.tasks import grading_of
    from services.common import grading
    from services.reward.verifiers.registry import build_verifier

    dataset = builder_config.dataset
    try:
        if dataset.kind in GENERATED_SOURCES:
            build_verifier(dataset.grading()["verifier"], "dataset.verifier")
            return {}
        built = dataset.build(seed=builder_config.seed, train_size=0, eval_size=0)
        verifiers: dict[str, Any] = {}
        for task in (*built.train, *built.eval):
            if task.is_pair:
                continue    # a preference pair is never graded: it arrives scored
            name = task.metadata.get("verifier", "math")
            if name not in verifiers:
                verifiers[name] = build_verifier(name, f"dataset.verifier (task {task.task_id})")
            verifiers[name].check(grading.to_task(grading_of(task)))  # what the reward service gets
    except (ValueError, OSError) as exc:
        raise PreflightError(f"dataset: {exc}") from None
    return {"train": len(built.train), "eval": len(built.eval)}


def check_all(config_files: dict[str, pathlib.Path]) -> dict[str, Any]:
    """Every service's config, and the builder's dataset; the first problem raises PreflightError."""
    configs = {service: check_service(service, path) for service, path in config_files.items()}
    if "reward" in configs:  # the judge's endpoint, as the reward service sets it, for tasks naming llm_judge
        from services.reward.verifiers import judge

        try:
            judge.configure(configs["reward"].judge)
        except ValueError as exc:
            raise PreflightError(f"services.reward.{exc}") from None
    if "builder" in configs and configs["builder"].source == "dataset":
        check_dataset(configs["builder"])
    return configs
