"""Telemetry: a run's events read back from its TensorBoard event files, Weights & Biases only when installed and
configured (a stand-in module here: nothing leaves the machine), and the progress display on and off a terminal."""

from __future__ import annotations

import io
import json
import sys
import types

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from launcher.report import EventLog
from launcher.telemetry import WANDB_PROJECT_ENV, scalars
from launcher.watch import ProgressBar
from services.common.contracts import data_pb2

TRAINED, EVAL, DEPLOYED = data_pb2.VERSION_KIND_TRAINED, data_pb2.VERSION_KIND_EVAL, data_pb2.VERSION_KIND_DEPLOYED


def play(events: EventLog) -> None:
    events.add(data_pb2.VersionEvent(version=0, kind=EVAL, at=1000.0, metrics={"accuracy": 0.25}))
    for version, reward in ((1, 0.125), (2, 0.5), (3, 0.75)):
        events.add(data_pb2.VersionEvent(version=version, kind=TRAINED, at=1000.0 + version,
                                         metrics={"reward_mean": reward, "loss": -reward, "max_staleness_trained": 1}))
        events.add(data_pb2.VersionEvent(version=version, kind=DEPLOYED, at=1000.5 + version))
    events.add(data_pb2.VersionEvent(version=3, kind=EVAL, at=1004.0, metrics={"accuracy": 0.5, "final": 1}))


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(s.step, s.value) for s in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_every_metric_of_the_run_round_trips_through_tensorboard(tmp_path):
    events = EventLog(tmp_path / "run" / "metrics.jsonl")
    play(events)
    events.close()
    got = read_scalars(tmp_path / "run" / "tensorboard")
    assert got == {
        "trained/reward_mean": [(1, 0.125), (2, 0.5), (3, 0.75)],
        "trained/loss": [(1, -0.125), (2, -0.5), (3, -0.75)],
        "trained/max_staleness_trained": [(1, 1.0), (2, 1.0), (3, 1.0)],
        "eval/accuracy": [(0, 0.25), (3, 0.5)],
        "eval/final": [(3, 1.0)],
    }
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 8 and json.loads(lines[1])["reward_mean"] == 0.125  # metrics.jsonl as before


def test_scalars_are_readable_before_the_log_is_closed(tmp_path):
    events = EventLog(tmp_path / "metrics.jsonl")
    events.add(data_pb2.VersionEvent(version=1, kind=TRAINED, metrics={"reward_mean": 0.5}))
    assert read_scalars(tmp_path / "tensorboard") == {"trained/reward_mean": [(1, 0.5)]}
    events.close()


def test_events_without_metrics_write_no_event_file(tmp_path):
    events = EventLog(tmp_path / "metrics.jsonl")
    events.add(data_pb2.VersionEvent(version=1, kind=DEPLOYED, checkpoint_path="/x"))
    events.close()
    assert not (tmp_path / "tensorboard").exists()
    assert scalars({"kind": "checkpoint", "version": 1, "at": 5.0, "checkpoint_path": "/x", "ok": True}) == {}


class FakeWandbRun:
    def __init__(self) -> None:
        self.logged: list[dict] = []
        self.metrics: list[tuple] = []
        self.finished = False

    def define_metric(self, name, **kwargs) -> None:
        self.metrics.append((name, kwargs))

    def log(self, values: dict) -> None:
        self.logged.append(values)

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    run = FakeWandbRun()
    module = types.SimpleNamespace(inits=[])

    def init(**kwargs):
        module.inits.append(kwargs)
        return run

    module.init, module.run = init, run
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_gets_the_same_scalars_when_a_project_is_set(tmp_path, monkeypatch, fake_wandb):
    monkeypatch.setenv(WANDB_PROJECT_ENV, "meshrl-test")
    events = EventLog(tmp_path / "seed7" / "metrics.jsonl")
    play(events)
    events.close()
    assert fake_wandb.inits == [{"project": "meshrl-test", "name": "seed7", "dir": str(tmp_path / "seed7")}]
    run = fake_wandb.run
    assert ("*", {"step_metric": "version"}) in run.metrics
    assert run.logged[0] == {"eval/accuracy": 0.25, "version": 0}
    assert run.logged[1] == {"trained/reward_mean": 0.125, "trained/loss": -0.125,
                             "trained/max_staleness_trained": 1.0, "version": 1}
    assert len(run.logged) == 5 and run.finished


def test_no_wandb_without_a_project(tmp_path, monkeypatch, fake_wandb):
    monkeypatch.delenv(WANDB_PROJECT_ENV, raising=False)
    play(EventLog(tmp_path / "metrics.jsonl"))
    assert fake_wandb.inits == []


def test_a_project_without_wandb_installed_only_warns(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(WANDB_PROJECT_ENV, "meshrl-test")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    events = EventLog(tmp_path / "metrics.jsonl")
    play(events)
    events.close()
    assert "wandb is not installed" in capsys.readouterr().err
    assert "trained/reward_mean" in read_scalars(tmp_path / "tensorboard")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_is_one_plain_line_per_step(tmp_path):
    stream = io.StringIO()
    bar, events = ProgressBar(3, enabled=True, stream=stream), EventLog(tmp_path / "metrics.jsonl")
    bar.update(events, 1.0)
    events.add(data_pb2.VersionEvent(version=1, kind=TRAINED, metrics={"reward_mean": 0.5}))
    bar.update(events, 2.0)
    bar.update(events, 3.0, restarts=1)  # the same step: no new line
    bar.close()
    events.close()
    assert stream.getvalue().splitlines() == [
        "step 0/3 | policy v0 | reward 0.000 | eval acc - | staleness max 0 | 1s",
        "step 1/3 | policy v0 | reward 0.500 | eval acc - | staleness max 0 | 2s",
    ]


def test_progress_on_a_terminal_is_a_tqdm_bar(tmp_path):
    stream = Terminal()
    bar, events = ProgressBar(4, enabled=True, stream=stream), EventLog(tmp_path / "metrics.jsonl")
    events.add(data_pb2.VersionEvent(version=2, kind=TRAINED, metrics={"reward_mean": 0.5}))
    bar.update(events, 2.0, restarts=2)
    bar.close()
    events.close()
    shown = stream.getvalue().split("\r")[-1]
    assert "2/4" in shown and "50%" in shown
    assert "reward 0.500" in shown and "restarts 2" in shown


def test_progress_disabled_prints_nothing(tmp_path):
    stream = Terminal()
    bar = ProgressBar(4, enabled=False, stream=stream)
    bar.update(EventLog(tmp_path / "metrics.jsonl"), 1.0)
    bar.close()
    assert stream.getvalue() == ""


def test_a_run_whose_held_out_accuracy_falls_far_below_its_start_says_so(tmp_path):
    EVAL = data_pb2.VERSION_KIND_EVAL
    stream = io.StringIO()
    bar, events = ProgressBar(4, enabled=True, stream=stream), EventLog(tmp_path / "metrics.jsonl")
    events.add(data_pb2.VersionEvent(version=0, kind=EVAL, metrics={"accuracy": 0.8125}))
    events.add(data_pb2.VersionEvent(version=1, kind=TRAINED, metrics={"reward_mean": 0.5}))
    events.add(data_pb2.VersionEvent(version=1, kind=EVAL, metrics={"accuracy": 0.75}))   # within the margin
    bar.update(events, 1.0)
    assert events.accuracy_warning == "" and "warning" not in stream.getvalue()
    events.add(data_pb2.VersionEvent(version=2, kind=TRAINED, metrics={"reward_mean": 0.2}))
    events.add(data_pb2.VersionEvent(version=2, kind=EVAL, metrics={"accuracy": 0.3125}))
    bar.update(events, 2.0)
    bar.close()
    events.close()
    last = stream.getvalue().splitlines()[-1]
    assert "warning: held-out accuracy fell from 0.812 to 0.312 by version 2" in last
    assert "services.trainer.optim.lr" in last
