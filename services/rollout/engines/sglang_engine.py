"""The SGLang engine: an SGLang server behind the rollout's engine interface, over its native HTTP API.

The engine starts `python -m sglang.launch_server` as a subprocess (or attaches to a server by URL) and waits for
`GET /health`; it records what the server reports (`GET /get_model_info`, `GET /server_info`, older servers
`/get_server_info`). Each sequence is one `POST /generate` (not streamed) with `input_ids`, `sampling_params`
(temperature, top_p, top_k: -1 when off, max_new_tokens, stop_token_ids) and `return_logprob: true`; the sampled
tokens and their log-probs come from `meta_info.output_token_logprobs` ([logprob, token id, text] per token),
`meta_info.finish_reason.type` says why it ended (stop, length, abort). The log-probs are SGLang's: under
softmax(logits / T) unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (then T = 1).

Versions. A request is only sent while the engine is not paused, and every token it returns is tagged with the
version loaded when it was sent. `pause_async()` closes the gate and `POST /pause_generation` (mode abort): the
server ends every request in flight with finish_reason abort and the tokens sampled so far, which are kept under
the old version (the weights change only once every request is back). A request still out after a grace period
(sent just before the pause) is cancelled here and keeps nothing. `resume_async(version)` loads the new weights
when the version changed, `POST /continue_generation`, and re-sends each interrupted sequence as prompt + its tokens
so far (the update flushes SGLang's prefix cache, so their KV cache is recomputed under the new weights): every
later token carries the new version. `abort(seq)` ends `seq` at once ("abort", callback once) and tells the server
(`POST /abort_request {rid}`).

Weights. `named_parameters()` are the tensors of a stage in this process (the model under its Hugging Face names,
the checkpoint's at start): the weight exchange's receiver writes into them while the engine is paused, and
`resume_async(version)` hands them to the server, as `sglang.weight_sync` says:
  disk         a checkpoint directory (`sglang.weights_dir`, seen by the server) + `/update_weights_from_disk`
  distributed  a broadcast from this process (rank 0) over a process group the server joined at start
               (`/init_weights_update_group`, backend `sglang.group_backend`: nccl on GPUs) +
               `/update_weights_from_distributed`
  worker       no stage: each TP worker of the server pulls its own shard from the trainer's senders and writes it
               into its live parameters in place (services.rollout.engines.sglang_worker, SGLang's custom weight
               loader driven through /update_weights_from_tensor; the server must be launched with
               --custom-weight-loader, which a started server is; results come back through files in
               `sglang.results_dir`, so the rollout and the server share a host or a filesystem)
  none         no updates (named_parameters() raises)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import pathlib
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

import httpx

from services.common.errors import FieldError
from services.common.net import free_port
from services.rollout.engines.sequence import Sequence, Status
from services.rollout.engines.server_engine import (
    LiveRequest,
    RequestRefused,
    ServerEngine,
    ServerStats,
    engine_args,
)
from services.rollout.engines.worker_pulls import WorkerPulls

WEIGHT_SYNCS = ("disk", "distributed", "worker", "none")
GROUP_BACKENDS = ("nccl", "gloo")  # gloo: CPU tensors (tests); nccl: GPU tensors
GROUP_NAME = "meshrl_weight_update"
PAUSE_GRACE = 5.0  # seconds for the server to hand back what /pause_generation aborted before we cancel the rest


@dataclasses.dataclass(kw_only=True)
class SGLangConfig:
    """The SGLang server behind `engine.kind: sglang` (model, context, batch, dtype, seed and initial version come
    from the engine section itself)."""

    url: str = ""                    # attach to a running server; empty: start one
    python: str = ""                 # an interpreter with sglang installed (relative: to the repository); empty: this one
    host: str = "127.0.0.1"          # a started server listens here
    port: int = 0                    # 0: a free port
    tp_size: int = 1                 # --tp-size of a started server
    mem_fraction_static: float = 0.0  # --mem-fraction-static; 0: SGLang's default
    extra_args: list[str] = dataclasses.field(default_factory=list)  # more launch_server arguments
    startup_timeout: float = 900.0   # seconds for a started server to answer /health
    request_timeout: float = 600.0   # seconds one /generate may take
    control_timeout: float = 300.0   # seconds for pause / continue / a weight update / the group's rendezvous
    connect_timeout: float = 10.0    # seconds to open a connection to the server
    max_connections: int = 512       # HTTP connections to the server (one per sequence in flight)
    weight_sync: str = "disk"        # disk | distributed | worker | none: how new weights reach the server (see the module)
    results_dir: str = ""            # worker: where the workers write each command's result; empty: run_dir or a temp dir
    weights_dir: str = ""            # disk: where checkpoints are written (the server reads them); empty: run_dir or a temp dir
    stage_dir: str = "/dev/shm"      # the stage's backing file (host memory)
    group_backend: str = "nccl"      # distributed: the process group's backend (nccl | gloo)
    group_address: str = "127.0.0.1"  # distributed: this host's address as the server's ranks reach it
    group_port: int = 0              # distributed: the rendezvous port here; 0: a free port
    log_file: str = ""               # a started server's output; empty: <run_dir>/sglang-server.log or a temp file

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise FieldError("engine.sglang.url", f"must start with http:// or https://, got {self.url!r}")
        for name in ("port", "group_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise FieldError(f"engine.sglang.{name}", f"must be in [0, 65535], got {getattr(self, name)}")
        if self.tp_size < 1:
            raise FieldError("engine.sglang.tp_size", f"must be >= 1, got {self.tp_size}")
        if not 0 <= self.mem_fraction_static < 1:
            raise FieldError("engine.sglang.mem_fraction_static", f"must be in [0, 1), got {self.mem_fraction_static}")
        for name in ("startup_timeout", "request_timeout", "control_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise FieldError(f"engine.sglang.{name}", f"must be a positive number of seconds, got {value!r}")
        if self.max_connections < 1:
            raise FieldError("engine.sglang.max_connections", f"must be >= 1, got {self.max_connections}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise FieldError("engine.sglang.weight_sync", f"must be one of {', '.join(WEIGHT_SYNCS)}, "
                             f"got {self.weight_sync!r}")
        if self.group_backend not in GROUP_BACKENDS:
            raise FieldError("engine.sglang.group_backend", f"must be one of {', '.join(GROUP_BACKENDS)}, "
                             f"got {self.group_backend!r}")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise FieldError("engine.sglang.extra_args", "must be strings")

    def build(self, *, model_path: str, max_batch: int, max_context: int, dtype: str = "float32", seed: int = 0,
              version: int = 0, run_dir: str = "") -> SGLangEngine:
        return SGLangEngine(self, **engine_args(model_path=model_path, max_batch=max_batch, max_context=max_context,
                                                dtype=dtype, seed=seed, version=version, run_dir=run_dir))


SGLangStats = ServerStats


class SGLangEngine(WorkerPulls, ServerEngine):
    kind = "sglang"
    name = "sglang"
    server_name = "SGLang"
    worker_setting = "engine.sglang.weight_sync"  # the setting that puts the weights in the workers
    layout_engine = "sglang"
    weights_off = "engine.sglang.weight_sync is none"
    startup_poll = 0.5
    watch_ping_timeout = 20.0

    def __init__(self, config: SGLangConfig, **engine_args) -> None:
        super().__init__(config, **engine_args)
        self.group = None
        self.model_info: dict = {}
        self.server_info: dict = {}
        self._init_worker_pulls()

    @property
    def in_workers(self) -> bool:
        return self.config.weight_sync == "worker"

    @property
    def connect_timeout(self) -> float:
        return self.config.connect_timeout

    # lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start (or attach to) the server, wait until it answers, read what it reports, and join the weight
        group (distributed). Blocking: call before serving."""
        import torch

        from services.rollout.engines.vllm_engine import Stage

        if self.config.weight_sync not in ("none", "worker") and self.stage is None:
            self.stage = Stage(self.model_path, getattr(torch, self.dtype), self.config.stage_dir)
        if not self.url:
            self._launch()
        self._wait_healthy()
        self.model_info = self._get_json("/get_model_info")
        self.server_info = self._server_info()
        if self.config.weight_sync == "distributed":
            self._join_group()
        if self.in_workers:
            # every DP replica's rank r would answer as TP rank r, and pipeline stages hold parts of the layers
            for field in ("dp_size", "pp_size"):
                if int(self.server_info.get(field) or 1) > 1:
                    raise FieldError("engine.sglang.weight_sync", f"worker needs a server with {field} 1 (it has "
                                     f"{self.server_info[field]}): run one server per replica, or use disk")
            body, command_id = self._worker_command("live", {})
            _request("POST", self.url + "/update_weights_from_tensor", body, self.config.control_timeout)
            self._register_workers(self._worker_results(command_id, "live"))
        self.log.info("sglang_ready", url=self.url, model=self.model_info.get("model_path"), version=self.version,
                      server_version=self.server_info.get("version"), tp_size=self.server_info.get("tp_size"),
                      weight_sync=self.config.weight_sync, started=self.process is not None)

    def _launch(self) -> None:
        c = self.config
        port = c.port or free_port(c.host)
        python = self._server_python(c.python or sys.executable)
        args = [str(python), "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", c.host,
                "--port", str(port), "--dtype", self.dtype, "--context-length", str(self._max_context),
                "--max-running-requests", str(self.max_batch), "--random-seed", str(self.seed),
                "--tp-size", str(c.tp_size), "--served-model-name", "meshrl-policy"]
        if c.mem_fraction_static:
            args += ["--mem-fraction-static", str(c.mem_fraction_static)]
        if self.in_workers:
            from services.rollout.engines.sglang_worker import LOADER

            args += ["--custom-weight-loader", LOADER]
        args += list(c.extra_args)
        self._spawn(args, self._server_env(), c.host, port)

    def _ping(self, timeout: float) -> None:
        _request("GET", self.url + "/health", None, timeout)

    def _startup_ping_timeout(self) -> float:
        return min(5.0, self.config.connect_timeout)

    def _get_json(self, path: str) -> dict:
        return json.loads(_request("GET", self.url + path, None, self.config.control_timeout) or "{}")

    def _server_info(self) -> dict:
        try:
            return self._get_json("/server_info")
        except RuntimeError as exc:  # servers before the rename answer /get_server_info only
            if "HTTP 404" not in str(exc):
                raise
            return self._get_json("/get_server_info")

    def _join_group(self) -> None:
        from services.rollout.engines.sglang_weights import open_group

        c = self.config
        tp = int(self.server_info.get("tp_size") or 1) * int(self.server_info.get("pp_size") or 1)
        port = c.group_port or free_port(c.group_address)
        body = {"master_address": c.group_address, "master_port": port, "rank_offset": 1, "world_size": tp + 1,
                "group_name": GROUP_NAME, "backend": c.group_backend}
        reply: dict = {}

        def ask() -> None:
            try:
                reply["body"] = _request("POST", self.url + "/init_weights_update_group", body, c.control_timeout)
            except Exception as exc:  # noqa: BLE001 - reported below
                reply["error"] = exc

        asker = threading.Thread(target=ask, name="sglang-init-group", daemon=True)
        asker.start()
        self.group = open_group(c.group_address, port, rank=0, world_size=tp + 1, backend=c.group_backend,
                                group_name=GROUP_NAME, timeout=c.control_timeout)
        asker.join(c.control_timeout)
        if "error" in reply or not json.loads(reply.get("body") or "{}").get("success", False):
            raise RuntimeError(f"SGLang /init_weights_update_group failed: {reply.get('error') or reply.get('body')}")

    def _close_weight_channel(self) -> None:
        if self.group is not None:
            from services.rollout.engines.sglang_weights import close_group

            close_group(self.group)
            self.group = None

    def _tell_server_aborted(self, live: LiveRequest) -> None:
        if live.rid and self._client is not None:  # frees the server's slot; the reply no longer matters
            self._loop.create_task(self._tell_abort(live.rid))

    async def _tell_abort(self, rid: str) -> None:
        try:
            await self._post("/abort_request", {"rid": rid}, timeout=self.config.control_timeout)
        except Exception as exc:  # noqa: BLE001 - the sequence has ended here either way
            self.log.warning("sglang_abort_request_failed", rid=rid, error=f"{type(exc).__name__}: {exc}")

    # pause, resume, weights --------------------------------------------------------------------------------------
    async def _pause_server(self, timeout: float) -> None:
        await self._post("/pause_generation", {"mode": "abort"}, timeout=timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), min(PAUSE_GRACE, timeout))
        except TimeoutError:
            self._interrupt_in_flight()  # sent as the pause began: the server holds it, we drop it
            await asyncio.wait_for(self._idle.wait(), timeout)

    async def _undo_failed_pause(self) -> None:
        with contextlib.suppress(Exception):
            await self._post("/continue_generation", {}, timeout=self.config.connect_timeout)

    async def _resume_server(self) -> None:
        await self._post("/continue_generation", {}, timeout=self.config.control_timeout)

    def weight_receiver_args(self) -> dict:
        return self._workers_receiver_args() if self.in_workers else super().weight_receiver_args()

    def _tp_size(self) -> int:
        return int(self.server_info.get("tp_size") or 1)

    def _worker_command(self, op: str, extra: dict) -> tuple[dict, str]:
        """The /update_weights_from_tensor body that runs one command in every TP worker, and the command's id."""
        import base64
        import pickle

        from services.rollout.engines.sglang_worker import LOADER, encode_command

        command_id = f"{op}-{uuid.uuid4().hex[:12]}"
        tp = self._tp_size()
        entries = [base64.b64encode(pickle.dumps(encode_command({  # SGLang's serializer format, plain tensors only
            "op": op, "id": command_id, "tp": tp, "tp_rank": rank, "result_dir": self._results_dir(), **extra})))
            .decode() for rank in range(tp)]
        return {"serialized_named_tensors": entries, "load_format": LOADER, "flush_cache": op == "commit"}, command_id

    def _worker_results(self, command_id: str, op: str) -> list[dict]:
        """Each TP worker's result of a command (RuntimeError naming the rank that failed or wrote none)."""
        from services.rollout.engines.sglang_worker import LOADER, result_path

        out = []
        for rank in range(self._tp_size()):
            path = result_path(self._results_dir(), command_id, rank)
            if not path.exists():
                raise RuntimeError(f"SGLang TP rank {rank} wrote no result for {op} in {path.parent}: is the server "
                                   f"launched with --custom-weight-loader {LOADER}, on this host?")
            result = json.loads(path.read_text())
            path.unlink()
            if "error" in result:
                raise RuntimeError(f"SGLang TP rank {rank}: {op}: {result['error']}")
            out.append(result)
        return out

    async def _worker_rpc(self, method: str, *args: str, timeout: float) -> list:
        op = method.removeprefix("meshrl_")
        extra = {"pull": lambda: {"job": json.loads(args[0])}, "commit": lambda: {"sync_id": args[0]},
                 "discard": dict}[op]()
        body, command_id = self._worker_command(op, extra)
        reply = await self._post("/update_weights_from_tensor", body, timeout=timeout)
        if not (reply or {}).get("success", False):
            raise RuntimeError(f"SGLang /update_weights_from_tensor ({op}) failed: {reply}")
        return [json.dumps(r) for r in self._worker_results(command_id, op)]

    def _results_dir(self) -> str:
        if not getattr(self, "_results", None):
            if self.config.results_dir:
                self._results = self.config.results_dir
            elif self.run_dir:
                self._results = str(pathlib.Path(self.run_dir) / "sglang-worker-results")
            else:
                self._results = tempfile.mkdtemp(prefix="meshrl-sglang-results-")
            pathlib.Path(self._results).mkdir(parents=True, exist_ok=True)
        return self._results

    async def _send_weights(self, version: int) -> dict:
        if self.in_workers:
            return self._take_pulled(version)
        if self.config.weight_sync == "disk":
            from services.rollout.engines.sglang_weights import write_checkpoint

            path = await asyncio.to_thread(write_checkpoint, self.stage.tensors, self.model_path, self._weights_dir(),
                                           version)
            reply = await self._post("/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "flush_cache": True},
                timeout=self.config.control_timeout)
        else:
            reply = await self._broadcast(version)
        if not (reply or {}).get("success", False):
            raise RuntimeError(f"SGLang weight update to version {version} failed: {reply}")
        return {"sync": self.config.weight_sync}

    def _count_interrupted(self) -> int:
        return sum(live.interrupted or s.status is Status.WAITING for s, live in self._live.items())

    async def _broadcast(self, version: int) -> dict | None:
        from services.rollout.engines.sglang_weights import broadcast_tensors

        assert self.group is not None, "distributed weight sync without a group (start() joins it)"
        tensors = self.stage.tensors
        body = {"names": list(tensors), "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                "shapes": [list(t.shape) for t in tensors.values()], "group_name": GROUP_NAME,
                "flush_cache": True, "weight_version": str(version)}
        device = "cuda" if self.config.group_backend == "nccl" else "cpu"
        asked = asyncio.ensure_future(self._post("/update_weights_from_distributed", body,
                                                 timeout=self.config.control_timeout))
        try:
            await asyncio.wait_for(asyncio.to_thread(broadcast_tensors, self.group, tensors, device),
                                   self.config.control_timeout)
        except BaseException:
            asked.cancel()
            raise
        return await asked

    def _weights_dir(self) -> str:
        if self.config.weights_dir:
            return self.config.weights_dir
        if self.run_dir:
            return str(pathlib.Path(self.run_dir) / "sglang-weights")
        if not getattr(self, "_temp_weights", None):
            self._temp_weights = tempfile.mkdtemp(prefix="meshrl-sglang-weights-")
        return self._temp_weights

    def _control_timeout(self, timeout: float) -> httpx.Timeout:
        return httpx.Timeout(timeout, connect=self.config.connect_timeout)

    # one sequence -----------------------------------------------------------------------------------------------
    async def _send(self, seq: Sequence, live: LiveRequest, max_tokens: int, version: int) -> str:
        """One /generate for the rest of `seq`; appends what it returns; returns the finish reason type."""
        s = seq.sampling
        live.rid = f"meshrl-{seq.seq_id}-{uuid.uuid4().hex[:8]}"
        body = {"input_ids": seq.context, "rid": live.rid, "stream": False, "return_logprob": True,
                "logprob_start_len": -1, "top_logprobs_num": 0,
                "sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
                                    "max_new_tokens": max_tokens, "stop_token_ids": list(s.stop_token_ids),
                                    "ignore_eos": s.ignore_eos, "skip_special_tokens": False}}
        self.stats.requests += 1
        response = await self._client.post("/generate", json=body)
        if response.status_code != 200:
            raise RequestRefused(response.status_code, response.text[:500])
        ids, logprobs, reason = parse_generate_reply(response.json())
        self.stats.steps += 1
        if ids and not live.aborted and seq.status is not Status.FINISHED:
            seq.output_ids.extend(ids)
            seq.logprobs.extend(logprobs)
            seq.versions.extend([version] * len(ids))
            self.stats.tokens_generated += len(ids)
            if not seq.first_token_at:
                seq.first_token_at = time.perf_counter()
        return reason

    def _own_fault(self, error: BaseException) -> bool:
        return isinstance(error, RequestRefused | _Malformed) and getattr(error, "status", 400) < 500

    def _outcome(self, reason: str, live: LiveRequest) -> str | None:
        if reason == "abort" and not live.aborted and not self._gate.is_set():
            return None  # /pause_generation ended it: its tokens are kept, the rest is asked for after resume
        return reason if reason in ("stop", "length", "abort") else "error"


class _Malformed(RuntimeError):
    """The server's reply does not follow SGLang's /generate schema."""


def parse_generate_reply(reply: dict) -> tuple[list[int], list[float], str]:
    """(token ids, log-probs, finish reason type) of a /generate reply; _Malformed when it does not fit."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict):
        raise _Malformed(f"/generate reply without meta_info: {str(reply)[:200]}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise _Malformed("/generate reply without meta_info.output_token_logprobs (return_logprob ignored?)")
    try:
        logprobs = [float(e[0]) for e in entries]
        ids = [int(e[1]) for e in entries]
    except (TypeError, ValueError, IndexError) as exc:
        raise _Malformed(f"meta_info.output_token_logprobs: expected [logprob, token_id, text] entries: {exc}") from exc
    output_ids = reply.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise _Malformed(f"output_ids {output_ids[:8]}... differ from output_token_logprobs' ids {ids[:8]}...")
    finish = meta.get("finish_reason")
    reason = finish.get("type", "") if isinstance(finish, dict) else str(finish or "")
    return ids, logprobs, reason


def _request(method: str, url: str, body: dict | None, timeout: float) -> str:
    """A blocking request (start-up, the group's join): the reply's text; RuntimeError on an HTTP error."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,  # noqa: S310 - the engine's own server
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:  # noqa: S310
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"SGLang {url}: HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}") from exc
