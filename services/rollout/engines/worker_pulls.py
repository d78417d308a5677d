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

    def _init_worker_pulls(self) -> None:
        self.workers: list[dict] = []           # what each worker reported at start
        self.receiver_shards: list | None = None
        self.receiver_parallel: dict[str, int] = {}
        self._pulled: tuple[int, dict] | None = None  # (version, details) committed into the workers, not resumed yet
        self.last_update: dict = {}             # the details of the last update taken (pull / commit seconds, bytes)

    def _register_workers(self, workers: list[dict]) -> None:
        self.workers = workers
        self.receiver_shards, self.receiver_parallel = worker_shards(workers, self.model_path, self.dtype,
                                                                     self.layout_engine)

    def _holds_weights(self) -> bool:
        return self.stage is not None or self.receiver_shards is not None

    def _pull_body(self, job) -> dict:
        return {**job.to_json(), "prefix_by_rank": len(self.workers) > 1}

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
