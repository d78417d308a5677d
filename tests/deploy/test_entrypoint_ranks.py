"""The image's entrypoint with MESHRL_TRAINER__RANKS > 1 (what components/trainer-ranks sets on Kubernetes): one
rank group inside the container, started by torchrun. Run here outside a container, with the repository's venv
first on PATH: two megatron-core ranks (tp=2) form their group, rank 0 serves and trains batches from a real
nats-server, and SIGTERM to the entrypoint's process stops every rank (none is left behind)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from services.common.batches import publish_batch
from services.common.bus import Bus
from tests.trainer.test_trainer_service import NEW, model_dir, training_batch, until  # noqa: F401 - a fixture

pytest.importorskip("megatron.core")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def marked(marker: str) -> list[int]:
    """The pids whose environment carries ``marker``."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


@pytest.mark.slow
async def test_the_entrypoint_runs_a_trainer_rank_group_with_torchrun(nats_server, model_dir, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump({
        "model_path": model_dir, "run_dir": str(run_dir), "nats_url": nats_server.url, "wx_address": "",
        "grpc_address": "127.0.0.1:0", "metrics_port": -1, "max_new_tokens": NEW, "checkpoint_every": 0,
        "backend": "megatron", "megatron": {"tp": 2}, "packing": {"enabled": False}, "total_steps": 0}))
    marker = f"MESHRL_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}", "POD_IP": "127.0.0.1",
           "MESHRL_TRAINER_CONFIG": str(config), "MESHRL_TRAINER__RANKS": "2", marker.split("=")[0]: marker.split("=")[1],
           "OMP_NUM_THREADS": "1"}
    log = tmp_path / "entrypoint.log"
    proc = subprocess.Popen(["sh", "deploy/docker/entrypoint.sh", "trainer"], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the process owns it
    bus = await Bus.connect(nats_server.url, name="test")
    try:
        for i in range(3):
            await publish_batch(bus, training_batch(i))
        metrics = run_dir / "trainer_metrics.jsonl"
        await until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, timeout=180,
                    what=f"three steps of the rank group (log: {log})")
        text = log.read_text()
        assert '"backend": "megatron", "ranks": 2' in text, text[-3000:]
        assert len(marked(marker)) >= 3   # torchrun and its two ranks
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        deadline = time.monotonic() + 30
        while marked(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marked(marker) == [], "a rank outlived the entrypoint's SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)
        await bus.close()
