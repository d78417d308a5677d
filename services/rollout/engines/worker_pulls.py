"""Weights received by a server engine's own workers (vLLM's worker extension, SGLang's custom weight loader): each
worker is the weight exchange's receiver of its own shard, and an update is two phases over every worker, a pull
into buffers and a commit into the live parameters, so that a failure anywhere leaves the old version whole.

The engine supplies `_worker_rpc(method, *args, timeout)` (methods meshrl_pull, meshrl_commit, meshrl_discard;
one JSON string back per worker, in rank order) and `_pull_body(job)`; this mixin does the rest the same way for
every engine: the receiver's shards from what the workers reported, the pull, the commit, the abandon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

from services.common.errors import FieldError


def worker_shards(workers: list[dict], model_path: str, dtype: str,
                  engine: str = "vllm") -> tuple[list, dict[str, int]]:
    """The receiver shards of an engine's workers from what each reported (name, shape, dtype of every parameter it
    holds), checked against the `engine` layout of the model (LayoutMismatch names each difference); with several
    workers each local name is prefixed `w<rank>/`, so one receiver holds every worker's shards without overlap."""
    from services.weight_exchange.client.layouts.live import live_layout
    from services.weight_exchange.client.layouts.model import model_spec

    spec = model_spec(model_path, dtype)
    shards = []
    for w in workers:
        params = {name: (tuple(shape), dt) for name, shape, dt, _ in w["params"]}
        layout = live_layout(f"{engine}-worker-{w['rank']}", params, spec, engine, tp=w["tp"], tp_rank=w["tp_rank"])
        prefix = f"w{w['rank']}/" if len(workers) > 1 else ""
        shards += [dataclasses.replace(s, local_name=prefix + s.local_name) for s in layout.shards]
    # what the workers share (sizes, not ranks)
    parallel = {k: v for k, v in layout.parallel.items() if k != "tp_rank"} | {"workers": len(workers)}
    return shards, parallel


def adapter_layout(workers: list[dict], full: list, r: int, targets: list[str]) -> tuple[list, dict, dict]:
    """For LoRA adapter syncs into the workers: (the receiver's shards: every adapter, whole, in every worker; the
    adapters' shapes; per worker rank, where each canonical shard of every live parameter an adapter touches lives,
    from `full`, the workers' full-model shards)."""
    from services.weight_exchange.client.layout import Shard
    from services.weight_exchange.client.regions import Region

    wanted = set(targets)
    adapted = {s.canonical_name: s.canonical_shape for s in full if len(s.canonical_shape) == 2
               and s.canonical_name.endswith(".weight")
               and s.canonical_name.removesuffix(".weight").rsplit(".", 1)[-1] in wanted}
    if not adapted:
        raise FieldError("engine.lora.target_modules", f"no linear weight of the model is named one of {sorted(wanted)}")
    shapes: dict[str, tuple[int, ...]] = {}
    for canonical, (rows, cols) in sorted(adapted.items()):
        module = canonical.removesuffix(".weight")
        shapes |= {f"{module}.lora_A.weight": (r, cols), f"{module}.lora_B.weight": (rows, r)}
    prefixes = [f"w{w['rank']}/" if len(workers) > 1 else "" for w in workers]
    shards = [Shard(name, shape, "float32", Region.full(shape), prefix + name, shape, Region.full(shape))
              for prefix in prefixes for name, shape in shapes.items()]
    touched = {s.local_name for s in full if s.canonical_name in adapted}
    plans: dict[str, dict[str, list]] = {str(w["rank"]): {} for w in workers}
    for s in full:
        if s.local_name in touched:
            rank, local = (s.local_name[1:].split("/", 1) if len(workers) > 1 else (str(workers[0]["rank"]),
                                                                                      s.local_name))
            plans[rank].setdefault(local, []).append([s.canonical_name, list(s.canonical_region.offsets),
                                                      list(s.canonical_region.sizes), list(s.local_region.offsets),
                                                      list(s.local_region.sizes)])
    return shards, {name: list(shape) for name, shape in shapes.items()}, plans


class WorkerPulls:
    """Mixed into a ServerEngine whose workers pull their own shards."""

    layout_engine = "vllm"
    server_name = "server"
    worker_setting = "engine.weight_path"

    def named_parameters(self) -> dict:
        if self.in_workers:
            raise RuntimeError(f"{self.worker_setting} is worker: the weights live in {self.server_name}'s workers, "
                               "which pull their own shards (weight_receiver_args)")
        return super().named_parameters()

    def _init_worker_pulls(self, adapters=None) -> None:
        self.adapters = adapters if adapters is not None and adapters.enabled else None   # engine.lora
        self._adapter_spec: dict = {}
        self.workers: list[dict] = []           # what each worker reported at start
        self.receiver_shards: list | None = None
        self.receiver_parallel: dict[str, int] = {}
        self._pulled: tuple[int, dict] | None = None  # (version, details) committed into the workers, not resumed yet
        self.last_update: dict = {}             # the details of the last update taken (pull / commit seconds, bytes)

    def take_adapters(self, adapters) -> None:
        """engine.lora (before start): updates carry the trainer's LoRA adapters, which the workers merge."""
        assert self.in_workers and not self.workers, "adapters are taken by a worker-sync engine before it starts"
        self._init_worker_pulls(adapters)

    def _register_workers(self, workers: list[dict]) -> None:
        self.workers = workers
        self.receiver_shards, self.receiver_parallel = worker_shards(workers, self.model_path, self.dtype,
                                                                     self.layout_engine)
        if self.adapters is not None:   # the workers receive the adapters and merge them themselves
            a = self.adapters
            self.receiver_shards, shapes, plans = adapter_layout(workers, self.receiver_shards, a.r,
                                                                 list(a.target_modules))
            self._adapter_spec = {"shapes": shapes, "plans": plans, "scale": a.alpha / a.r,
                                  "model_path": self.model_path}

    def _holds_weights(self) -> bool:
        return self.stage is not None or self.receiver_shards is not None

    def _pull_body(self, job) -> dict:
        return {**job.to_json(), "prefix_by_rank": len(self.workers) > 1,
                **({"adapters": self._adapter_spec} if self.adapters is not None else {})}

    def _workers_receiver_args(self) -> dict:
        """Keyword arguments for the weight exchange's ReceiverAgent: the workers' shards and `pull`."""
        if self.receiver_shards is None:
            raise RuntimeError(f"the {self.server_name} engine is not started: its workers have not reported their "
                               "parameters")
        return {"params": {}, "shards": self.receiver_shards, "parallel": self.receiver_parallel,
                "framework": self.layout_engine, "pull": self.pull_into_workers}

    async def pull_into_workers(self, job):
        """Each worker pulls its planned bytes (phase one), then all commit them (phase two); any failure discards
        what every worker pulled and raises TransportError (TransferTimeout past the job's deadline) naming it."""
        from services.weight_exchange.client.sink import PullResult
        from services.weight_exchange.client.wire import TransferTimeout, TransportError

        if not self._paused:
            raise RuntimeError(f"pull version {job.version}: the engine is not paused")
        started = time.monotonic()
        try:
            # the server's own deadline after the workers' (theirs names the link and tensor that stalled)
            pulled = [json.loads(r) for r in await self._worker_rpc("meshrl_pull", json.dumps(self._pull_body(job)),
                                                                    timeout=job.timeout + 30.0)]
            committed = [json.loads(r) for r in await self._worker_rpc("meshrl_commit", job.sync_id,
                                                                         timeout=self.config.control_timeout)]
        except Exception as exc:  # noqa: BLE001 - every failure abandons the update in every worker
            with contextlib.suppress(Exception):
                await self._worker_rpc("meshrl_discard", timeout=30.0)
            late = time.monotonic() - started >= job.timeout or isinstance(exc, TimeoutError | asyncio.TimeoutError)
            ranks = ", ".join(str(w["rank"]) for w in self.workers)
            raise (TransferTimeout if late else TransportError)(
                f"{self.server_name} workers (ranks {ranks}): {type(exc).__name__}: {exc}") from exc
        seconds = time.monotonic() - started
        details = {"workers": len(pulled), "bytes": sum(p["bytes_received"] for p in pulled),
                   "delta": job.delta_base is not None,
                   "pull_seconds": round(max(p["seconds"] for p in pulled), 4),
                   "commit_seconds": round(max(c["seconds"] for c in committed), 4),
                   "packed": sum(c["packed"] for c in committed), "in_place": sum(c["in_place"] for c in committed),
                   "unchanged": sum(c["unchanged"] for c in committed)}
        self._pulled = (job.version, details)
        checksum = ",".join(p["checksum"] for p in pulled) if job.verify else ""
        return PullResult(details["bytes"], seconds, checksum, sum(p["bytes_full"] for p in pulled))

    def _take_pulled(self, version: int) -> dict:
        """At resume: the details of the update the workers committed for `version`."""
        if self._pulled is None or self._pulled[0] != version:
            raise RuntimeError(f"version {version} was not pulled into the {self.server_name} workers")
        details, self._pulled = self._pulled[1], None
        self.last_update = details
        return details
