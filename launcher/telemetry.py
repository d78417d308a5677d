"""A run's per-step metrics as TensorBoard scalars, and in Weights & Biases when `wandb` is installed and
MESHRL_WANDB_PROJECT names a project. Each event record becomes scalars `<kind>/<metric>` at step = its version."""

from __future__ import annotations

import os
import pathlib
import sys

WANDB_PROJECT_ENV = "MESHRL_WANDB_PROJECT"
NOT_METRICS = ("kind", "version", "at", "checkpoint_path")


def scalars(record: dict) -> dict[str, float]:
    return {f"{record['kind']}/{key}": float(value) for key, value in record.items()
            if key not in NOT_METRICS and isinstance(value, int | float) and not isinstance(value, bool)}


class Telemetry:
    """Opens its writers on the first metric, so a run that reports none leaves no empty event file."""

    def __init__(self, log_dir: pathlib.Path, *, run_name: str = "") -> None:
        self.log_dir = log_dir
        self.run_name = run_name or log_dir.parent.name
        self._tensorboard = None
        self._wandb = None
        self._opened = False

    def add(self, record: dict) -> None:
        values = scalars(record)
        if not values:
            return
        if not self._opened:
            self._open()
        step = int(record["version"])
        if self._tensorboard is not None:
            for tag, value in values.items():
                self._tensorboard.add_scalar(tag, value, global_step=step, walltime=record.get("at") or None)
            self._tensorboard.flush()  # readable while the run goes on, and after a crash
        if self._wandb is not None:
            self._wandb.log({**values, "version": step})

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._tensorboard = self._wandb = None
        self._opened = False

    def _open(self) -> None:
        self._opened = True
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # a venv older than requirements.txt: metrics.jsonl still has everything
            print(f"telemetry: no TensorBoard event files ({exc}); run `make setup`", file=sys.stderr)
        else:
            self._tensorboard = SummaryWriter(log_dir=str(self.log_dir))
        self._wandb = _wandb_run(self.run_name, self.log_dir)


def _wandb_run(name: str, log_dir: pathlib.Path):
    project = os.environ.get(WANDB_PROJECT_ENV, "")
    if not project:
        return None
    try:
        import wandb
    except ImportError:
        print(f"telemetry: {WANDB_PROJECT_ENV} is set but wandb is not installed", file=sys.stderr)
        return None
    run = wandb.init(project=project, name=name, dir=str(log_dir.parent))
    # events of several kinds share a version and may arrive out of order: step by version, not by wandb's counter
    run.define_metric("version")
    run.define_metric("*", step_metric="version")
    return run
