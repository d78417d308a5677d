"""The five services as processes on a real nats-server: the model improves, eta holds, gRPC answers."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time

import grpc
import pytest

from launcher.stack import SERVICES, health_check, random_ports, run
from services.common.contracts import data_pb2, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
GRPCURL = str(pathlib.Path(sys.executable).parent / "grpcurl")


def probe(stack, found: dict) -> None:
    found["health"] = {s: health_check(stack.address(s)) for s in SERVICES}
    listed = subprocess.run([GRPCURL, "-plaintext", stack.address("trainer"), "list"], capture_output=True,
                            text=True, timeout=30)
    found["grpcurl_list"] = listed.stdout
    operator = (("authorization", f"Bearer {stack.operator_token}"),)
    with grpc.insecure_channel(stack.address("rollout")) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        try:
            stub.Generate(rollout_pb2.GenerateRequest(n=1), timeout=30, metadata=operator)
        except grpc.RpcError as exc:
            found["invalid"] = (exc.code(), exc.details())
        reply = stub.Generate(rollout_pb2.GenerateRequest(prompt_ids=[ord(c) for c in "12+30="], n=2), timeout=60,
                              metadata=operator)
        found["generated"] = [list(c.versions) for c in reply.completions]
    found["spanning"] = threading.Thread(target=generate_across_an_update, args=(stack, found), daemon=True)
    found["spanning"].start()


def generate_across_an_update(stack, found: dict, deadline_s: float = 300.0) -> None:
    """Long generations back to back while the run trains, until one runs across a weight update: the engine is
    interrupted, keeps the sequence, and tags the later tokens with the new version. (The builder's own prompts
    span an update only when generation is the bottleneck, which on a fast machine it is not.)"""
    operator = (("authorization", f"Bearer {stack.operator_token}"),)
    sampling = data_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=200, ignore_eos=True)
    request = rollout_pb2.GenerateRequest(prompt_ids=[ord(c) for c in "12+30="], sampling=sampling, n=1)
    end = time.monotonic() + deadline_s
    with grpc.insecure_channel(stack.address("rollout")) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        while time.monotonic() < end:
            try:
                versions = list(stub.Generate(request, timeout=60, metadata=operator).completions[0].versions)
            except grpc.RpcError:
                return  # the run ended
            found["long"] = versions
            if len(set(versions)) >= 2:
                return


def test_asynchronous_rl_loop_improves_the_model(tmp_path):
    found: dict = {}
    summary = run("configs/e2e.yaml", name="e2e", seed=0, ports=random_ports(), runs_root=tmp_path, progress=False,
                  on_healthy=lambda stack, events: probe(stack, found))
    run_dir = tmp_path / "e2e"
    assert found["health"] == {s: True for s in SERVICES}
    assert "meshrl.v1.TrainerService" in found["grpcurl_list"] and "grpc.health.v1.Health" in found["grpcurl_list"]
    assert found["invalid"][0] == grpc.StatusCode.INVALID_ARGUMENT and "prompt_ids" in found["invalid"][1]
    assert len(found["generated"]) == 2
    assert summary["completed"], summary
    assert summary["exit_codes"] == {s: 0 for s in SERVICES}, "every service stopped cleanly on SIGTERM"
    assert summary["steps"] == 40
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.05, summary["eval_curve"]
    assert summary["max_staleness_trained"] <= summary["eta"] == 1
    found["spanning"].join(timeout=60)
    versions = found["long"]
    assert len(versions) == 200 and len(set(versions)) >= 2, "a generation was interrupted by a weight update"
    assert versions == sorted(versions), "tokens after the update carry the newer version"
    assert summary["trajectories_trained"] == 40 * 64 * 8
    for name in ("metrics.jsonl", "reward_accuracy.png", "summary.json", "final/model.safetensors",
                 "final/config.json", "final/tokenizer.json"):
        assert (run_dir / name).exists(), name
