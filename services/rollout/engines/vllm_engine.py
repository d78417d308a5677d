"""The vLLM engine: a vLLM OpenAI api_server (its own venv, .venv-vllm) behind the rollout's engine interface.

The engine starts the server as a subprocess (or attaches to one by URL) with `VLLM_SERVER_DEV_MODE=1`, the
scale-out routes (`--enable-scale-out`: the token-in route `POST /inference/v1/generate`) and the worker extension
`services.rollout.engines.vllm_worker.WeightUpdateExtension`. Each sequence is one streamed token-in / token-out
request: token ids in, token ids and the sampled token's log-prob out (`sampling_params.logprobs = 0`; with
`logprobs_mode: processed_logprobs` the log-prob is under softmax(logits / T), as the embedded engine's, when no
top-k / top-p truncation applies; under raw_logprobs it is always T = 1).

Versions. A request is only sent while the engine is not paused, and every token it returns is tagged with the
version loaded when it was sent. `pause_async()` closes the gate, cancels every request in flight (closing the
stream aborts it in vLLM), then pauses vLLM's scheduler (`POST /pause?mode=abort`, which also clears the prefix
cache). `resume_async(version)` loads the new weights when the version changed (`/collective_rpc` ->
`meshrl_load_staged`), resumes vLLM (`POST /resume`) and re-sends each interrupted sequence as prompt + the tokens
it has so far, for the tokens it still lacks: its KV cache is recomputed under the new weights and every later token
carries the new version, as in the embedded engine. A token is only kept when its stream was read before the
pause, so no token sampled by the old weights is ever tagged with the new version.

Weights (`weight_path`). **worker** (the default): vLLM's own workers are the weight exchange's receivers of their
shards. At start each worker reports what it holds (vllm_worker.py: fused `qkv_proj` / `gate_up_proj`, padded
vocabulary, its TP rank's slice); `weight_receiver_args()` registers that as the rollout's receiver layout (local
names `w<rank>/...` when the engine has several workers), so the coordinator plans exactly each worker's bytes. At
an update the rollout's receiver keeps the control plane (the signed Apply, pause, resume) and hands the plan to
the workers (`/collective_rpc` -> `meshrl_pull`): each pulls its own bytes from the trainer's senders into buffers,
and only once every worker has all of its bytes do they become the live weights (`meshrl_commit`; a failed pull is
discarded everywhere, so vLLM never serves a half-updated model). Nothing in this process holds the weights.
**stage**: `named_parameters()` are the tensors of one file in /dev/shm holding the model under its Hugging Face
names (the checkpoint's at start, in the engine's dtype); the receiver writes into them while the engine is paused
and `resume_async(version)` has vLLM's worker map the same file and reload the whole model from it.
Either way the weights travel on this host: a server attached by URL must run on the same machine for weight
updates (`weight_updates: false` turns them off).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import pathlib
import sys
import uuid

import numpy as np
import torch

from services.common.errors import FieldError
from services.common.net import free_port
from services.rollout.engines.sequence import Sampling, Sequence, Status
from services.rollout.engines.server_engine import (
    LiveRequest,
    RequestRefused,
    ServerEngine,
    ServerStats,
    engine_args,
    http_get,
    http_post_json,
    read_json,
)
from services.rollout.engines.worker_pulls import WorkerPulls

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
WEIGHT_PATHS = ("worker", "stage")
WORKER_EXTENSION = "services.rollout.engines.vllm_worker.WeightUpdateExtension"
_stage_ids = itertools.count()


@dataclasses.dataclass(kw_only=True)
class VLLMConfig:
    """The vLLM server behind `engine.kind: vllm` (the model, context, batch, dtype and initial version come from
    the engine section itself)."""

    url: str = ""                    # attach to a running server (dev mode, --enable-scale-out, the extension); empty: start one
    python: str = ".venv-vllm/bin/python"  # the vLLM venv's interpreter (relative: to the repository); scripts/vllm_venv.sh builds it
    host: str = "127.0.0.1"          # a started server listens here
    port: int = 0                    # 0: a free port
    kv_cache_gib: int = 1            # VLLM_CPU_KVCACHE_SPACE (CPU builds): the KV cache, GiB
    omp_threads_bind: str = ""       # VLLM_CPU_OMP_THREADS_BIND (CPU builds), e.g. "0-1"; empty: vLLM's default (auto)
    logprobs_mode: str = "processed_logprobs"  # processed_logprobs (under temperature) | raw_logprobs (T = 1)
    prefix_caching: bool = True      # vLLM's automatic prefix caching (its /metrics count hits; a pause clears it)
    extra_args: list[str] = dataclasses.field(default_factory=list)  # more api_server arguments, e.g. ["--enforce-eager"]
    startup_timeout: float = 600.0   # seconds for a started server to answer /health (CPU: ~2-3 min for SmolLM2)
    request_timeout: float = 600.0   # seconds a streamed request may stay silent
    control_timeout: float = 300.0   # seconds for pause / resume / a weight load
    max_connections: int = 512       # HTTP connections to the server (one per sequence in flight)
    weight_updates: bool = True      # take the trainer's weights in place
    weight_path: str = "worker"      # worker: each vLLM worker pulls its own shard | stage: a /dev/shm stage, reloaded
    stage_dir: str = "/dev/shm"      # weight_path stage: where the stage file lives (shared with the server's worker)
    log_file: str = ""               # a started server's stdout and stderr; empty: <run_dir>/vllm-server.log or a temp file
    # --enable-return-routed-experts: each finished request returns the experts every fed token was routed to (MoE
    # routing replay); the engine section's record_routes sets it
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise FieldError("vllm.url", f"must start with http:// or https://, got {self.url!r}")
        if not 0 <= self.port <= 65535:
            raise FieldError("vllm.port", f"must be in [0, 65535], got {self.port}")
        if self.kv_cache_gib < 1:
            raise FieldError("vllm.kv_cache_gib", f"must be >= 1, got {self.kv_cache_gib}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise FieldError("vllm.logprobs_mode", f"must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        for name in ("startup_timeout", "request_timeout", "control_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise FieldError(f"vllm.{name}", f"must be a positive number of seconds, got {value!r}")
        if self.weight_path not in WEIGHT_PATHS:
            raise FieldError("vllm.weight_path", f"must be one of {', '.join(WEIGHT_PATHS)}, got {self.weight_path!r}")
        if self.max_connections < 1:
            raise FieldError("vllm.max_connections", f"must be >= 1, got {self.max_connections}")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise FieldError("vllm.extra_args", "must be strings")

    def build(self, *, model_path: str, max_batch: int, max_context: int, dtype: str = "float32", seed: int = 0,
              version: int = 0, run_dir: str = "") -> VLLMEngine:
        return VLLMEngine(self, **engine_args(model_path=model_path, max_batch=max_batch, max_context=max_context,
                                              dtype=dtype, seed=seed, version=version, run_dir=run_dir))


VLLMStats = ServerStats


def routed_experts(encoded: str) -> torch.Tensor:
    """vLLM's `routed_experts` (base64 of a .npy, [tokens - 1, layers, top_k]) as expert indices."""
    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if array.ndim != 3:
        raise RuntimeError(f"vLLM returned routed experts of shape {array.shape}, not [tokens, layers, top_k]")
    return torch.from_numpy(array.astype(np.int16))


class Stage:
    """The model's tensors under their Hugging Face names in one /dev/shm file, which vLLM's worker maps too (same
    host: it opens the file as /proc/<this pid>/fd/<fd>)."""

    def __init__(self, model_path: str, dtype: torch.dtype, directory: str) -> None:
        from safetensors import safe_open

        model = pathlib.Path(model_path)
        files = sorted(model.glob("*.safetensors"))
        if not files:
            raise FieldError("engine.model_path", f"no *.safetensors in {model_path!r}")
        tied = bool(read_json(model / "config.json").get("tie_word_embeddings", False))
        entries: list[tuple[str, tuple[int, ...], pathlib.Path]] = []
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                    if tied and name == "lm_head.weight":
                        continue  # the embedding's alias: written through embed_tokens
                    entries.append((name, tuple(st.get_slice(name).get_shape()), f))
        itemsize = torch.tensor([], dtype=dtype).element_size()
        self.dtype = dtype
        self.layout: list[tuple[str, tuple[int, ...], int]] = []
        offset = 0
        for name, shape, _ in entries:
            self.layout.append((name, shape, offset))
            offset += -(-math.prod(shape) * itemsize // 64) * 64  # 64-byte aligned
        self.size = max(offset, 64)
        self.path = pathlib.Path(directory) / f"meshrl-vllm-stage-{os.getpid()}-{next(_stage_ids)}-{uuid.uuid4().hex[:8]}"
        with open(self.path, "wb") as fh:
            fh.truncate(self.size)
        buf = torch.from_file(str(self.path), shared=True, size=self.size, dtype=torch.uint8)
        # unlinked at once, kept open: the worker opens it through /proc/<pid>/fd, and nothing is left in /dev/shm
        # when this process dies, however it dies
        self._fd = os.open(self.path, os.O_RDWR)
        self.path.unlink()
        self.shared_path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shape, off in self.layout:
            n = math.prod(shape) * itemsize
            self.tensors[name] = buf[off:off + n].view(dtype).view(shape)
        by_file: dict[pathlib.Path, list[str]] = {}
        for name, _, f in entries:
            by_file.setdefault(f, []).append(name)
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as st:
                for name in names:
                    self.tensors[name].copy_(st.get_tensor(name))

    def manifest(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return json.dumps({"path": self.shared_path, "size": self.size,
                           "tensors": [[n, dtype, list(s), o] for n, s, o in self.layout]})

    def close(self) -> None:
        self.tensors = {}
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class VLLMEngine(WorkerPulls, ServerEngine):
    kind = "vllm"
    name = "vllm"
    worker_setting = "engine.vllm.weight_path"  # the setting that puts the weights in the workers
    layout_engine = "vllm"      # the weight exchange's layout rules (vllm_ascend: fused experts kept transposed)
    server_name = "vLLM"
    weights_off = "engine.vllm.weight_updates is off"

    def __init__(self, config: VLLMConfig, **engine_args) -> None:
        super().__init__(config, **engine_args)
        self.stage: Stage | None = None
        self.served_model = ""
        self._init_worker_pulls()               # weight_path worker
        self._transposed: list[str] = []        # local names the workers hold transposed (vLLM-Ascend's experts)

    @property
    def in_workers(self) -> bool:
        return self.config.weight_updates and self.config.weight_path == "worker"

    def start(self) -> None:
        """Start (or attach to) the server and wait until it answers (blocking: call before serving)."""
        if self.config.weight_updates and not self.in_workers and self.stage is None:
            self.stage = Stage(self.model_path, getattr(torch, self.dtype), self.config.stage_dir)
        if not self.url:
            self._launch()
        self._wait_healthy()
        models = json.loads(http_get(self.url + "/v1/models", 30.0))
        self.served_model = models["data"][0]["id"]
        if self.in_workers:
            from services.weight_exchange.client.layouts.inference import is_transposed

            reply = http_post_json(self.url + "/collective_rpc", {"method": "meshrl_live_params",
                                   "timeout": self.config.control_timeout}, self.config.control_timeout)
            self._register_workers([json.loads(r) for r in reply["results"]])
            self._transposed = sorted({n for w in self.workers for n, *_ in w["params"]
                                       if is_transposed(self.layout_engine, n)})
        self.log.info("vllm_ready", url=self.url, model=self.served_model, version=self.version,
                      started=self.process is not None)

    def _launch(self) -> None:
        c = self.config
        port = c.port or free_port(c.host)
        python = self._server_python(c.python, " (build it: bash scripts/vllm_venv.sh)")
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--host", c.host, "--port", str(port), "--dtype", self.dtype,
                "--max-model-len", str(self._max_context), "--max-num-seqs", str(self.max_batch),
                "--seed", str(self.seed), "--enable-scale-out", "--logprobs-mode", c.logprobs_mode,
                "--served-model-name", "meshrl-policy", "--disable-uvicorn-access-log",
                "--enable-prefix-caching" if c.prefix_caching else "--no-enable-prefix-caching"]
        if self.config.weight_updates:
            args += ["--worker-extension-cls", WORKER_EXTENSION]
        if c.return_routed_experts:
            args += ["--enable-return-routed-experts"]
        args += list(c.extra_args)
        env = self._server_env()
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if c.return_routed_experts:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM returns routed experts from its V2 model runner only
        env["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_gib)
        if c.omp_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = c.omp_threads_bind
        env.pop("VIRTUAL_ENV", None)
        self._spawn(args, env, c.host, port)

    # pause, resume, weights --------------------------------------------------------------------------------------
    async def _pause_server(self, timeout: float) -> None:
        self._interrupt_in_flight()  # closing a stream aborts its request in vLLM
        await asyncio.wait_for(self._idle.wait(), timeout)
        await self._post("/pause", params={"mode": "abort", "clear_cache": "true"}, timeout=timeout)

    async def _resume_server(self) -> None:
        await self._post("/resume", timeout=self.config.control_timeout)

    def weight_receiver_args(self) -> dict:
        """Keyword arguments for the weight exchange's ReceiverAgent: the workers' shards and `pull` (worker), or
        the stage's tensors."""
        return self._workers_receiver_args() if self.in_workers else {"params": self.named_parameters()}

    def _pull_body(self, job) -> dict:
        return {**super()._pull_body(job), "transposed": self._transposed}

    async def _worker_rpc(self, method: str, *args: str, timeout: float) -> list:
        reply = await self._post("/collective_rpc", {"method": method, "args": list(args), "timeout": timeout},
                                 timeout=timeout + 10.0)
        return (reply or {}).get("results") or []

    async def _send_weights(self, version: int) -> dict:
        if self.in_workers:
            return self._take_pulled(version)
        reply = await self._post("/collective_rpc", {
            "method": "meshrl_load_staged", "args": [self.stage.manifest()],
            "timeout": self.config.control_timeout}, timeout=self.config.control_timeout)
        return {"result": (reply or {}).get("results")}

    # one sequence -----------------------------------------------------------------------------------------------
    async def _send(self, seq: Sequence, live: LiveRequest, max_tokens: int, version: int) -> str:
        """One streamed request for the rest of `seq`; returns vLLM's finish reason ("" if the stream ended early)."""
        s = seq.sampling
        body = {"token_ids": seq.context, "stream": True, "model": self.served_model, "output_mode": "tokens",
                "request_id": f"meshrl-{seq.seq_id}-{uuid.uuid4().hex[:8]}",
                "sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                    "max_tokens": max_tokens, "stop_token_ids": list(s.stop_token_ids),
                                    "ignore_eos": s.ignore_eos, "logprobs": 0, "detokenize": False, "skip_special_tokens": False}}
        self.stats.requests += 1
        async with self._client.stream("POST", "/inference/v1/generate", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                raise RequestRefused(response.status_code, text)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    raise RuntimeError(f"vLLM: {chunk['error']}")
                self.stats.steps += 1
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    content = ((choice.get("logprobs") or {}).get("content")) or []
                    if ids and not live.aborted and not live.interrupted and seq.status is not Status.FINISHED:
                        if len(content) != len(ids):
                            raise RuntimeError(f"vLLM returned {len(ids)} tokens with {len(content)} log-probs")
                        seq.output_ids.extend(ids)
                        seq.logprobs.extend(float(c["logprob"]) for c in content)
                        seq.versions.extend([version] * len(ids))
                        self.stats.tokens_generated += len(ids)
                    if choice.get("routed_experts") and not live.aborted and not live.interrupted:
                        # every token this request fed (its prompt: the sequence so far), as one forward routed
                        # them: replaces what an interrupted earlier request of the sequence returned
                        seq.routes = [routed_experts(choice["routed_experts"])]
                    if choice.get("finish_reason"):
                        return choice["finish_reason"]
        return ""

    def _outcome(self, reason: str, live: LiveRequest) -> str | None:
        if reason == "abort" and (live.interrupted or not self._gate.is_set()):
            return None  # vLLM aborted it for the pause before our cancel landed
        if not reason:
            self.stats.steps_failed += 1  # the stream ended without a finish reason
            return "error"
        return reason

if __name__ == "__main__":  # pragma: no cover - a manual smoke run: python -m services.rollout.engines.vllm_engine DIR
    async def _main() -> None:
        engine = VLLMConfig().build(model_path=sys.argv[1], max_batch=8, max_context=512)
        await asyncio.to_thread(engine.start)
        try:
            seqs = await engine.generate([1, 2, 3], Sampling(temperature=0.0, max_new_tokens=8))
            print(seqs[0].output_ids, seqs[0].logprobs, seqs[0].versions)
        finally:
            engine.stop()

    asyncio.run(_main())
