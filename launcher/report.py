"""Run artifacts: metrics.jsonl (every event), TensorBoard scalars, the reward / accuracy plot, summary.json."""

from __future__ import annotations

import json
import pathlib

import grpc
from google.protobuf.json_format import MessageToDict

from launcher.phases import phase_report
from launcher.telemetry import Telemetry
from services.common.contracts import (
    builder_pb2_grpc,
    common_pb2,
    data_pb2,
    reward_pb2_grpc,
    rollout_pb2_grpc,
    trainer_pb2_grpc,
)

# held-out accuracy this far (absolute) below the run's first evaluation: said in the progress line and the summary
ACCURACY_DROP_WARNING = 0.15

KIND = {data_pb2.VERSION_KIND_TRAINED: "trained", data_pb2.VERSION_KIND_DEPLOYED: "deployed",
        data_pb2.VERSION_KIND_CHECKPOINT: "checkpoint", data_pb2.VERSION_KIND_EVAL: "eval",
        data_pb2.VERSION_KIND_RUN_END: "run_end", data_pb2.VERSION_KIND_BUDGET: "budget"}


class EventLog:
    """Every version event of a run, appended to metrics.jsonl as it arrives; its metrics also go to
    TensorBoard (`tensorboard/` beside metrics.jsonl) and, when configured, Weights & Biases."""

    def __init__(self, path: pathlib.Path, *, telemetry: Telemetry | None = None) -> None:
        self.path = path
        self.records: list[dict] = []
        self.telemetry = telemetry or Telemetry(path.parent / "tensorboard")

    def add(self, event: data_pb2.VersionEvent) -> None:
        record = {"kind": KIND.get(event.kind, "unknown"), "version": event.version, "at": event.at,
                  **({"checkpoint_path": event.checkpoint_path} if event.checkpoint_path else {}),
                  **dict(event.metrics)}
        self.records.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.telemetry.add(record)

    def close(self) -> None:
        self.telemetry.close()

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["kind"] == kind]

    @property
    def version(self) -> int:
        return max((r["version"] for r in self.of("trained")), default=0)

    @property
    def deployed(self) -> int:
        return max((r["version"] for r in self.of("deployed")), default=0)

    @property
    def last_reward(self) -> float:
        trained = self.of("trained")
        return trained[-1].get("reward_mean", 0.0) if trained else 0.0

    @property
    def last_accuracy_text(self) -> str:
        evals = self.of("eval")
        return f"{evals[-1]['accuracy']:.3f}" if evals else "-"

    @property
    def accuracy_warning(self) -> str:
        """"" unless the latest held-out accuracy fell ACCURACY_DROP_WARNING or more below the first one (a
        learning rate too high for the model is the usual cause)."""
        evals = self.of("eval")
        if len(evals) < 2 or evals[0]["accuracy"] - evals[-1]["accuracy"] < ACCURACY_DROP_WARNING:
            return ""
        return (f"held-out accuracy fell from {evals[0]['accuracy']:.3f} to {evals[-1]['accuracy']:.3f} by version "
                f"{evals[-1]['version']}: the learning rate (services.trainer.optim.lr) may be too high for this model")

    @property
    def max_staleness(self) -> int:
        return int(max((r.get("max_staleness_trained", 0) for r in self.of("trained")), default=0))


def _statuses(stack) -> dict:
    out = {}
    stubs = {"builder": builder_pb2_grpc.BuilderServiceStub, "trainer": trainer_pb2_grpc.TrainerServiceStub,
             "rollout": rollout_pb2_grpc.RolloutServiceStub, "reward": reward_pb2_grpc.RewardServiceStub}
    token = getattr(stack, "operator_token", "")  # a launched stack's operator token
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    for service, stub in stubs.items():
        with grpc.insecure_channel(stack.address(service)) as channel:
            try:
                reply = stub(channel).Status(common_pb2.StatusRequest(), timeout=5, metadata=metadata)
                out[service] = MessageToDict(reply, preserving_proto_field_name=True,
                                             always_print_fields_with_no_presence=True)
            except grpc.RpcError as exc:
                out[service] = {"error": str(exc.code())}
    return out


def plot(events: EventLog, path: pathlib.Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained, evals = events.of("trained"), events.of("eval")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["version"] for r in trained], [r.get("reward_mean", 0) for r in trained], label="train reward (batch mean)")
    ax.plot([r["version"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)")
    ax.set_xlabel("policy version (training steps)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(stack, events: EventLog, run_dir: pathlib.Path, *, eta: int, agents: bool, seed: int, algo: str,
                 wall_seconds: float, completed: bool) -> dict:
    status = _statuses(stack)
    evals = events.of("eval")
    trained = events.of("trained")
    builder, trainer, rollout = status.get("builder", {}), status.get("trainer", {}), status.get("rollout", {})
    before = evals[0]["accuracy"] if evals else None
    finals = [e for e in evals if e.get("final")]
    after = finals[-1]["accuracy"] if finals else None
    summary = {
        "completed": completed,
        "algo": algo,
        "eval_accuracy_before": before,
        "eval_accuracy_after": after,
        "eval_accuracy_gain": None if before is None or after is None else after - before,
        "steps": events.version,
        "wall_seconds": round(wall_seconds, 1),
        "trajectories_generated": int(rollout.get("trajectories_published", 0)),
        "trajectories_trained": int(trainer.get("trajectories_trained", 0)),
        "trajectories_dropped_stale": int(builder.get("trajectories_dropped_stale", 0)),
        "groups_filtered": int(builder.get("groups_filtered", 0)),  # dynamic sampling: no reward variance
        "extra_prompts_issued": int(builder.get("extra_prompts_issued", 0)),  # ... and the prompts in their place
        "max_staleness_trained": int(trainer.get("max_staleness_trained", 0)),
        "max_versions_in_one_trajectory": int(max((r.get("max_versions_in_one_trajectory", 0) for r in trained),
                                                  default=0)),
        "interrupted_sequences": int(rollout.get("interrupted_sequences", 0)),
        "weight_updates_applied": int(rollout.get("weight_updates", 0)),
        "eta": eta,
        "seed": seed,
        "eval_curve": [{"version": e["version"], "accuracy": e["accuracy"]} for e in evals],
        "final_checkpoint": next((c["checkpoint_path"] for c in reversed(events.of("checkpoint"))), None),
        "status": status,
    }
    cpu = stack.cpu_seconds() if hasattr(stack, "cpu_seconds") else None  # a remote stack's are not ours to read
    if cpu:  # where the run's CPU went, start-up included: the services' processes (with their children), nats
        summary["cpu_seconds"] = {**cpu, "total": round(sum(cpu.values()), 2)}
    if events.accuracy_warning:
        summary["warnings"] = [events.accuracy_warning]
    if agents:
        rewards = [r.get("reward_mean", 0.0) for r in trained]
        quarter = max(1, len(rewards) // 4)
        summary["agent_reward_first_quarter"] = sum(rewards[:quarter]) / quarter if rewards else None
        summary["agent_reward_last_quarter"] = sum(rewards[-quarter:]) / quarter if rewards else None
        summary["agent_reward_curve"] = [{"version": r["version"], "reward_mean": r.get("reward_mean", 0.0)}
                                         for r in trained]
    if trained or evals:
        plot(events, run_dir / "reward_accuracy.png", title=f"meshrl: asynchronous {algo}, eta={summary['eta']}")
    summary["phases"] = phase_report(events, run_dir, title=f"meshrl: where the time goes ({algo}, eta={summary['eta']})")
    events.close()
    return summary
