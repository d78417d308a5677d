"""Contracts: messages round-trip, and the committed stubs match proto/ (run `make proto` when this fails)."""

from __future__ import annotations

import filecmp
import importlib.util
import pathlib

from services.common import grading
from services.common.contracts import data_pb2, weight_exchange_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_trajectory_round_trip_keeps_per_token_fields():
    traj = data_pb2.Trajectory(
        trajectory_id="t-1", group_id="g", task_id="add-1-2", prompt_ids=[1, 2, 3], completion_ids=[4, 5],
        behavior_logprobs=[-0.5, -1.25], versions=[3, 4], loss_mask=[1, 1], reward=1.0, group_size=8,
        grading=grading.to_proto({"answer": "3"}), source="workflow")
    back = data_pb2.Trajectory.FromString(traj.SerializeToString())
    assert back == traj
    assert list(back.versions) == [3, 4] and list(back.behavior_logprobs) == [-0.5, -1.25]
    assert grading.to_task(back.grading) == {"answer": "3"}


def test_batch_event_and_layout_round_trip():
    batch = data_pb2.TrainingBatch(batch_id="b", index=7, trajectories=[data_pb2.Trajectory(trajectory_id="x")])
    assert data_pb2.TrainingBatch.FromString(batch.SerializeToString()) == batch
    event = data_pb2.VersionEvent(version=3, kind=data_pb2.VERSION_KIND_TRAINED, metrics={"loss": 0.5})
    assert data_pb2.VersionEvent.FromString(event.SerializeToString()).metrics["loss"] == 0.5
    layout = data_pb2.RankLayout(rank_id="r", role=data_pb2.RANK_ROLE_SENDER, shards=[data_pb2.ShardSpec(
        canonical_name="w", canonical_shape=[4, 2], canonical_region=data_pb2.TensorRegion(offsets=[2, 0], sizes=[2, 2]))])
    assert data_pb2.RankLayout.FromString(layout.SerializeToString()) == layout
    req = weight_exchange_pb2.SyncRequest(version=4, transport="shm")
    assert weight_exchange_pb2.SyncRequest.FromString(req.SerializeToString()).version == 4


def test_generated_stubs_are_not_stale(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    committed = ROOT / "services" / "common" / "contracts" / "meshrl" / "v1"
    fresh = tmp_path / "meshrl" / "v1"
    names = sorted(p.name for p in fresh.iterdir() if p.suffix in (".py", ".pyi"))
    assert names == sorted(p.name for p in committed.iterdir() if p.suffix in (".py", ".pyi"))
    match, mismatch, errors = filecmp.cmpfiles(committed, fresh, names, shallow=False)
    assert not mismatch and not errors, f"stale stubs (run `make proto`): {mismatch + errors}"
