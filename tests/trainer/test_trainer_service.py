"""The trainer against a real nats-server (no weight exchange): batches read by index, crash and resume from the
newest complete checkpoint, dead-lettered batches skipped, and a SIGKILLed service process that finishes the run."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
import yaml

from services.common.batches import batch_subject, publish_batch
from services.common.bus import Bus
from services.common.contracts import data_pb2
from services.common.runtime import cancel_and_wait
from services.trainer.checkpoint import MANIFEST, latest_checkpoint, read_lineage
from services.trainer.config import TrainerConfig
from services.trainer.optim import OptimConfig
from services.trainer.server import Trainer
from tests.trainer.test_trainer_engine import make_model_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
NEW = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def training_batch(index: int, *, groups: int = 2, group: int = 4) -> data_pb2.TrainingBatch:
    g = torch.Generator().manual_seed(index)
    trajs = []
    for i in range(groups * group):
        completion = torch.randint(0, 128, (NEW,), generator=g).tolist()
        trajs.append(data_pb2.Trajectory(
            trajectory_id=f"t{index}-{i}", group_id=f"g{index}-{i // group}", group_size=group,
            prompt_ids=torch.randint(0, 128, (3,), generator=g).tolist(), completion_ids=completion,
            behavior_logprobs=[-5.0] * NEW, versions=[index] * NEW, loss_mask=[1] * NEW,
            reward=sum(c < 64 for c in completion) / NEW, finish_reason="length"))
    return data_pb2.TrainingBatch(batch_id=f"batch-{index}", index=index, trajectories=trajs,
                                  group_ids=sorted({t.group_id for t in trajs}))


def config_for(model_dir: str, run_dir: pathlib.Path, url: str, **kwargs) -> TrainerConfig:
    return TrainerConfig(model_path=model_dir, run_dir=str(run_dir), nats_url=url, wx_address="", max_new_tokens=NEW,
                         optim=OptimConfig(lr=3e-3), checkpoint_every=2, **kwargs)


async def until(condition, timeout: float = 60.0, what: str = "condition") -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def names(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


async def version_events(bus: Bus) -> dict[str, data_pb2.VersionEvent]:
    info = await bus.js.stream_info("EVENTS")
    out = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        event = data_pb2.VersionEvent.FromString((await bus.js.get_msg("EVENTS", seq)).data)
        out[event.event_id] = event
    return out


async def test_a_crashed_trainer_resumes_from_its_newest_complete_checkpoint(nats_server, model_dir, tmp_path):
    bus = await Bus.connect(nats_server.url, name="test")
    config = config_for(model_dir, tmp_path / "run", nats_server.url, total_steps=7)
    checkpoints = tmp_path / "run" / "checkpoints"
    try:
        for i in range(6):
            await publish_batch(bus, training_batch(i))
        first = Trainer(config, bus)
        assert first.resume() is None
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(stop))
        await until(lambda: names(checkpoints) == ["v4", "v6"], what="checkpoint v6 (v2 pruned)")
        assert await cancel_and_wait([task]) == []  # a crash: no final checkpoint, nothing flushed
        assert first.version == 6 and first.lineage["batch_indices"] == list(range(6))
        weights_v6 = {n: t.clone() for n, t in first.engine.weights().items()}
        (checkpoints / "v6" / MANIFEST).unlink()  # ... that happened while v6 was being written

        second = Trainer(config, bus)
        assert second.resume() == checkpoints / "v4" and second.version == 4
        assert second.lineage == {"batch_indices": [0, 1, 2, 3], "batch_ids": [f"batch-{i}" for i in range(4)],
                                  "skipped": []}
        assert not (checkpoints / "v6").exists()  # the incomplete one is cleaned
        assert second.trajectories_trained == 4 * 8
        stop = asyncio.Event()
        task = asyncio.create_task(second.run(stop))
        await until(lambda: second.version == 6, what="batches 4 and 5 again")
        for name, tensor in second.engine.weights().items():  # the same batches from the same state: same weights
            assert torch.equal(tensor, weights_v6[name]), name
        await publish_batch(bus, training_batch(6))
        await until(lambda: read_lineage(tmp_path / "run" / "final") is not None, what="the final checkpoint")
        stop.set()
        await task
        assert read_lineage(tmp_path / "run" / "final") == {
            "batch_indices": list(range(7)), "batch_ids": [f"batch-{i}" for i in range(7)], "skipped": [],
            "version": 7}
        assert latest_checkpoint(checkpoints) == checkpoints / "v7"
        events = await version_events(bus)
        assert events["trained-7"].metrics["batch_index"] == 6.0
        assert {"checkpoint-7-final", "checkpoint-7-v7", "checkpoint-4-v4"} <= set(events)
    finally:
        await bus.close()


async def test_an_invalid_batch_is_dead_lettered_and_skipped(nats_server, model_dir, tmp_path):
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        await publish_batch(bus, training_batch(0))
        torn = training_batch(1)
        del torn.trajectories[0].loss_mask[:]                                 # pack refuses it
        await publish_batch(bus, torn)
        await bus.js.publish(batch_subject(2), b"not a batch")                # undecodable
        huge = training_batch(3)
        huge.trajectories[0].completion_ids[0] = 1 << 20                      # outside the vocabulary
        await publish_batch(bus, huge)
        await publish_batch(bus, training_batch(4))
        trainer = Trainer(config_for(model_dir, tmp_path / "run", nats_server.url), bus)
        trainer.resume()
        stop = asyncio.Event()
        task = asyncio.create_task(trainer.run(stop))
        await until(lambda: trainer.version == 5, what="version 5")
        stop.set()
        await task
        assert trainer.lineage == {"batch_indices": [0, 4], "batch_ids": ["batch-0", "batch-4"], "skipped": [1, 2, 3]}
        assert (await bus.dead_letter_counts())["trainer"] == 3
        letter = data_pb2.DeadLetter.FromString((await bus.js.get_last_msg("DLQ", "dlq.trainer")).data)
        assert letter.consumer == "trainer" and letter.subject == batch_subject(3) and "vocabulary" in letter.reason
        events = await version_events(bus)
        assert dict(events["trained-2"].metrics) == {"skipped": 1.0, "batch_index": 1.0, "trajectories_trained": 8.0}
        assert "skipped" not in events["trained-5"].metrics and events["trained-5"].metrics["batch_index"] == 4.0
    finally:
        await bus.close()


class RecordingSender:
    """Stands in for the weight exchange's SenderAgent: records the update brackets and fails syncs as told."""

    def __init__(self, failures: dict[int, list[grpc.StatusCode]]) -> None:
        self.calls: list[tuple] = []
        self.failures = failures

    def begin_update(self) -> None:
        self.calls.append(("begin",))

    def end_update(self, version: int) -> None:
        self.calls.append(("end", version))

    async def sync(self, version: int, **_kwargs):
        self.calls.append(("sync", version))
        if self.failures.get(version):
            code = self.failures[version].pop(0)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)
        return type("Reply", (), {"num_receivers": 1})()


async def test_steps_are_bracketed_for_the_sender_and_failed_syncs_are_retried(nats_server, model_dir, tmp_path):
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        for i in range(2):
            await publish_batch(bus, training_batch(i))
        trainer = Trainer(config_for(model_dir, tmp_path / "run", nats_server.url, sync_retries=2), bus)
        trainer.sender = RecordingSender({1: [grpc.StatusCode.UNAVAILABLE],
                                          2: [grpc.StatusCode.FAILED_PRECONDITION]})  # not retried
        stop = asyncio.Event()
        task = asyncio.create_task(trainer.run(stop))
        await until(lambda: ("sync", 2) in trainer.sender.calls, what="version 2 synced")
        stop.set()
        await task
        assert trainer.sender.calls == [("begin",), ("end", 1), ("sync", 1), ("sync", 1),
                                        ("begin",), ("end", 2), ("sync", 2)]
        assert trainer.last_metrics["weight_sync_failures"] == 1.0 and trainer.sync_failures == 1
    finally:
        await bus.close()


def start_service(config_path: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "MESHRL_TRAINER_CONFIG": str(config_path)}
    return subprocess.Popen([sys.executable, "-m", "services.trainer"], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the process owns it


@pytest.mark.slow
async def test_a_sigkilled_trainer_process_restarts_and_finishes_the_run(nats_server, model_dir, tmp_path):
    total = 12
    run_dir = tmp_path / "run"
    config_path = tmp_path / "trainer.yaml"
    config_path.write_text(yaml.safe_dump({
        "model_path": model_dir, "run_dir": str(run_dir), "nats_url": nats_server.url, "wx_address": "",
        "grpc_address": "127.0.0.1:0", "metrics_port": -1, "max_new_tokens": NEW, "checkpoint_every": 2,
        "total_steps": total, "optim": {"lr": 3.0e-3}}))
    bus = await Bus.connect(nats_server.url, name="test")
    log = tmp_path / "trainer.log"
    proc = start_service(config_path, log)
    try:
        for i in range(total):
            await publish_batch(bus, training_batch(i))
        metrics = run_dir / "trainer_metrics.jsonl"
        await until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, what="three steps")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        resumed = latest_checkpoint(run_dir / "checkpoints")
        proc = start_service(config_path, log)
        final = run_dir / "final"
        await until(lambda: (read_lineage(final) or {}).get("version") == total, timeout=120, what="the final checkpoint")
        lineage = read_lineage(final)
        assert lineage["batch_indices"] == list(range(total)) and lineage["skipped"] == []
        assert lineage["batch_ids"] == [f"batch-{i}" for i in range(total)]
        assert resumed is not None  # v2 is written before step 3 starts
        assert f'"resumed_from": "{resumed}"' in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        await bus.close()


@pytest.mark.slow
@pytest.mark.parametrize("on_stop", [True, False])
async def test_a_sigtermed_trainer_keeps_its_steps_since_the_last_checkpoint(nats_server, model_dir, tmp_path, on_stop):
    run_dir = tmp_path / "run"
    config_path = tmp_path / "trainer.yaml"
    config_path.write_text(yaml.safe_dump({
        "model_path": model_dir, "run_dir": str(run_dir), "nats_url": nats_server.url, "wx_address": "",
        "grpc_address": "127.0.0.1:0", "metrics_port": -1, "max_new_tokens": NEW, "checkpoint_every": 5,
        "total_steps": 10, "optim": {"lr": 3.0e-3}, "checkpoint_on_stop": on_stop}))
    bus = await Bus.connect(nats_server.url, name="test")
    proc = start_service(config_path, tmp_path / "trainer.log")
    try:
        for i in range(3):
            await publish_batch(bus, training_batch(i))
        metrics = run_dir / "trainer_metrics.jsonl"
        await until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, what="three steps")
        proc.send_signal(signal.SIGTERM)  # waiting for batch 3, which never comes
        assert proc.wait(timeout=60) == 0
        if on_stop:  # v3 although checkpoint_every is 5: a restart resumes there, batches 0-2 are not trained again
            assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "v3"
            assert "checkpoint-3-v3" in await version_events(bus)
        else:
            assert latest_checkpoint(run_dir / "checkpoints") is None
    finally:
        if proc.poll() is None:
            proc.kill()
        await bus.close()


@pytest.mark.parametrize("threads", [1, 2])
async def test_steps_run_on_the_compute_thread_with_torch_threads_and_the_main_thread_stays_at_one(
        threads, nats_server, model_dir, tmp_path):
    """One OpenMP team per process: a second one (the main thread's, from building the model) made libgomp throttle
    its spin-waits and every parallel op slower."""
    before = torch.get_num_threads()
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        await publish_batch(bus, training_batch(0))
        trainer = Trainer(config_for(model_dir, tmp_path / "run", nats_server.url, torch_threads=threads), bus)
        seen: list[tuple[str, int]] = []
        step = trainer.engine.step

        def recording_step(*args, **kwargs):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return step(*args, **kwargs)

        trainer.engine.step = recording_step
        stop = asyncio.Event()
        task = asyncio.create_task(trainer.run(stop))
        await until(lambda: trainer.version == 1, what="batch 0")
        stop.set()
        await task
        main_threads = torch.get_num_threads()
        trainer.compute.close()
    finally:
        await bus.close()
        torch.set_num_threads(before)
    assert [(name.startswith("trainer-compute"), n) for name, n in seen] == [(True, threads)]
    assert main_threads == 1
