"""Runs inside SGLang's tensor-parallel workers: each worker pulls its own shard of new weights, in place
(`engine.sglang.weight_sync: worker`).

SGLang runs a custom weight loader inside every TP worker when `POST /update_weights_from_tensor` names it as its
`load_format`, if the server was launched with `--custom-weight-loader <that import path>` (the engine adds it).
Each worker gets its own entry of `serialized_named_tensors` (SGLang's MultiprocessingSerializer format: base64 of
a pickle; its SafeUnpickler admits plain tensors). The rollout sends every rank one entry, `[("meshrl", uint8
tensor)]`, whose bytes are the JSON of one command:

  live     report what this worker holds (`named_parameters()`: SGLang's fused qkv_proj / gate_up_proj, padded
           vocabulary, this TP rank's slice), for the receiver layout the coordinator plans against
  pull     phase one: this rank's planned bytes from the trainer's senders (the weight exchange's data plane:
           CMA / shm / tcp) into buffers; the live weights are untouched, so a failure anywhere leaves every
           worker serving the old version whole
  commit   phase two: the buffers are copied into the live parameters, in place
  discard  drop what a pull left

SGLang answers the route with success whatever a loader does, and an exception would end its scheduler, so the
loader never raises: each command's result (or error) is written as JSON to `<result_dir>/<id>-rank<r>.json`
(same host or a shared filesystem), which the rollout reads back. Only the standard library and torch are imported
at the top: this module runs in SGLang's environment; `pull` imports the weight exchange's data plane.

Not run against a real SGLang server here (none runs in this workplace): tested against a contract double that
calls the loader as SGLang's model runner does.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import torch

PAYLOAD_NAME = "meshrl"
LOADER = "services.rollout.engines.sglang_worker.meshrl_weights"


def encode_command(command: dict) -> list[tuple[str, torch.Tensor]]:
    """What one rank's entry of serialized_named_tensors holds (before SGLang's serializer)."""
    return [(PAYLOAD_NAME, torch.frombuffer(bytearray(json.dumps(command).encode()), dtype=torch.uint8))]


def meshrl_weights(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom weight loader entry point: run the command and write its result; never raises."""
    command: dict = {}
    try:
        (name, payload), = named_tensors
        if name != PAYLOAD_NAME:
            raise ValueError(f"serialized_named_tensors: expected one {PAYLOAD_NAME!r} entry, got {name!r}")
        command = json.loads(bytes(payload.cpu().numpy()).decode())
        result = COMMANDS[command["op"]](model, command)
    except Exception as exc:  # noqa: BLE001 - an exception here would end SGLang's scheduler
        result = {"error": f"{type(exc).__name__}: {exc}"}
    if command.get("result_dir"):
        write_result(command, result)


def write_result(command: dict, result: dict) -> None:
    path = result_path(command["result_dir"], command["id"], int(command["tp_rank"]))
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"tp_rank": command["tp_rank"], **result}))
    os.replace(partial, path)   # the reader never sees half a result


def result_path(result_dir: str, command_id: str, tp_rank: int) -> pathlib.Path:
    return pathlib.Path(result_dir) / f"{command_id}-rank{tp_rank}.json"


def live_tensors(model: torch.nn.Module) -> dict:
    """name -> (module, tensor, shape, packed) as vllm_worker.pull_buffers reads it: SGLang keeps plain tensors."""
    return {name: (None, param.data, tuple(param.shape), False) for name, param in model.named_parameters()}


def _live(model: torch.nn.Module, command: dict) -> dict:
    params = [[name, list(t.shape), str(t.dtype).removeprefix("torch."), False]
              for name, (_, t, _, _) in live_tensors(model).items()]
    return {"rank": command["tp_rank"], "tp": command["tp"], "tp_rank": command["tp_rank"], "params": params}


def _pull(model: torch.nn.Module, command: dict) -> dict:
    from services.rollout.engines.vllm_worker import job_for, pull_buffers

    started = time.perf_counter()
    rank = int(command["tp_rank"])
    job = job_for(command["job"], rank)
    model._meshrl_pending = None
    raw = command["job"]
    if "adapters" in raw:   # LoRA: pull the adapters, merge them into buffers of the parameters they touch
        from services.rollout.engines.worker_adapters import pull_merged

        buffers, result = pull_merged(model, job, raw["adapters"], rank, live_tensors(model))
    else:
        buffers = pull_buffers(job, live_tensors(model), {}, f"SGLang TP rank {rank}")
        result = job.run(buffers)
    model._meshrl_pending = (job.sync_id, buffers)
    return {"bytes_received": result.bytes_received, "bytes_full": result.bytes_full,
            "seconds": time.perf_counter() - started, "checksum": result.checksum, "tensors": len(buffers)}


def _commit(model: torch.nn.Module, command: dict) -> dict:
    started = time.perf_counter()
    pending = getattr(model, "_meshrl_pending", None)
    if pending is None or pending[0] != command["sync_id"]:
        raise RuntimeError(f"TP rank {command['tp_rank']}: nothing pulled for update {command['sync_id']}")
    model._meshrl_pending = None
    live = live_tensors(model)
    in_place = unchanged = 0
    with torch.no_grad():
        for name, buffer in pending[1].items():
            param = live[name][1]
            if torch.equal(buffer, param):
                unchanged += 1
                continue
            param.copy_(buffer)
            in_place += 1
    return {"in_place": in_place, "packed": 0, "unchanged": unchanged, "seconds": time.perf_counter() - started}


def _discard(model: torch.nn.Module, command: dict) -> dict:
    model._meshrl_pending = None
    return {}


COMMANDS = {"live": _live, "pull": _pull, "commit": _commit, "discard": _discard}
