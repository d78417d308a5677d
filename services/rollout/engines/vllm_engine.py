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

Weights. `named_parameters()` are the tensors of a *stage*: one file in /dev/shm holding the model under its
Hugging Face names (the checkpoint's at start, in the engine's dtype). The weight exchange's receiver writes into
them in place while the engine is paused; `resume_async(version)` has vLLM's worker map the same file and load it
(vllm_worker.py). The stage lives on this host: a server attached by URL must run on the same machine for weight
updates (`weight_updates: false` turns them off).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import httpx
import torch

from services.common.logging import get_logger
from services.rollout.engines.base import check_request
from services.rollout.engines.sequence import Sampling, Sequence, Status

DTYPES = ("float32", "bfloat16")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
ROOT = pathlib.Path(__file__).resolve().parents[3]
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
    extra_args: list[str] = dataclasses.field(default_factory=list)  # more api_server arguments, e.g. ["--enforce-eager"]
    startup_timeout: float = 600.0   # seconds for a started server to answer /health (CPU: ~2-3 min for SmolLM2)
    request_timeout: float = 600.0   # seconds a streamed request may stay silent
    control_timeout: float = 300.0   # seconds for pause / resume / a weight load
    max_connections: int = 512       # HTTP connections to the server (one per sequence in flight)
    weight_updates: bool = True      # keep a /dev/shm stage of the weights for in-place updates
    stage_dir: str = "/dev/shm"      # where the stage file lives (shared with the server's worker)
    log_file: str = ""               # a started server's stdout and stderr; empty: <run_dir>/vllm-server.log or a temp file

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"vllm.url: must start with http:// or https://, got {self.url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"vllm.port: must be in [0, 65535], got {self.port}")
        if self.kv_cache_gib < 1:
            raise ValueError(f"vllm.kv_cache_gib: must be >= 1, got {self.kv_cache_gib}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"vllm.logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        for name in ("startup_timeout", "request_timeout", "control_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"vllm.{name}: must be a positive number of seconds, got {value!r}")
        if self.max_connections < 1:
            raise ValueError(f"vllm.max_connections: must be >= 1, got {self.max_connections}")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError("vllm.extra_args: must be strings")

    def build(self, *, model_path: str, max_batch: int, max_context: int, dtype: str = "float32", seed: int = 0,
              version: int = 0, run_dir: str = "") -> VLLMEngine:
        if dtype not in DTYPES:
            raise ValueError(f"engine.dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if max_batch < 1:
            raise ValueError(f"engine.max_batch: must be >= 1, got {max_batch}")
        if max_context < 2:
            raise ValueError(f"engine.max_context: must be >= 2, got {max_context}")
        model = pathlib.Path(model_path)
        if not (model / "config.json").is_file():
            raise ValueError(f"engine.model_path: {model_path!r} is not a Hugging Face model directory (config.json)")
        config = json.loads((model / "config.json").read_text())
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        eos = _eos_ids(model, config)
        return VLLMEngine(self, model_path=str(model), max_batch=max_batch, max_context=max_context, dtype=dtype,
                          seed=seed, version=version, vocab_size=int(vocab) if vocab else None, eos_token_ids=eos,
                          run_dir=run_dir)


def _eos_ids(model: pathlib.Path, config: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (config, _read_json(model / "generation_config.json")):
        value = source.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return tuple(dict.fromkeys(ids))


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclasses.dataclass
class VLLMStats:
    tokens_generated: int = 0
    sequences_finished: int = 0
    weight_updates: int = 0
    interrupted_sequences: int = 0
    sequences_aborted: int = 0
    sequences_failed: int = 0
    steps_failed: int = 0            # requests the server failed (HTTP errors, broken streams)
    steps: int = 0                   # streamed chunks read
    busy_seconds: float = 0.0        # wall seconds with at least one request in flight
    requests: int = 0                # HTTP requests sent (a resumed sequence sends another)
    weight_load_seconds: float = 0.0


class Stage:
    """The model's tensors under their Hugging Face names in one /dev/shm file, which vLLM's worker maps too (same
    host: it opens the file as /proc/<this pid>/fd/<fd>)."""

    def __init__(self, model_path: str, dtype: torch.dtype, directory: str) -> None:
        from safetensors import safe_open

        model = pathlib.Path(model_path)
        files = sorted(model.glob("*.safetensors"))
        if not files:
            raise ValueError(f"engine.model_path: no *.safetensors in {model_path!r}")
        tied = bool(_read_json(model / "config.json").get("tie_word_embeddings", False))
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


class VLLMEngine:
    kind = "vllm"

    def __init__(self, config: VLLMConfig, *, model_path: str, max_batch: int, max_context: int, dtype: str,
                 seed: int, version: int, vocab_size: int | None, eos_token_ids: tuple[int, ...],
                 run_dir: str = "") -> None:
        self.config = config
        self.model_path = model_path
        self.max_batch = max_batch
        self._max_context = max_context
        self.dtype = dtype
        self.seed = seed
        self.version = version
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.run_dir = run_dir
        self.stats = VLLMStats()
        self.url = config.url.rstrip("/")
        self.process: subprocess.Popen | None = None
        self.stage: Stage | None = None
        self.served_model = ""
        self.log = get_logger().bind(engine="vllm")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._live: dict[Sequence, _Live] = {}
        self._gate: asyncio.Event | None = None       # set while requests may be sent
        self._idle: asyncio.Event | None = None       # set while no request is in flight
        self._inflight = 0
        self._busy_since = 0.0
        self._pause_requests = 0
        self._paused = False
        self._stopped = False
        self._control = None                           # asyncio.Lock: one pause / resume at a time
        self._log_handle = None

    # lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start (or attach to) the server and wait until it answers (blocking: call before serving)."""
        if self.config.weight_updates and self.stage is None:
            self.stage = Stage(self.model_path, getattr(torch, self.dtype), self.config.stage_dir)
        if not self.url:
            self._launch()
        self._wait_healthy()
        models = json.loads(_get(self.url + "/v1/models", 30.0))
        self.served_model = models["data"][0]["id"]
        self.log.info("vllm_ready", url=self.url, model=self.served_model, version=self.version,
                      started=self.process is not None)

    def _launch(self) -> None:
        c = self.config
        port = c.port or _free_port(c.host)
        python = pathlib.Path(c.python)
        if not python.is_absolute():
            python = ROOT / python
        if not python.exists():
            raise RuntimeError(f"engine.vllm.python: {python} does not exist (build it: bash scripts/vllm_venv.sh)")
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--host", c.host, "--port", str(port), "--dtype", self.dtype,
                "--max-model-len", str(self._max_context), "--max-num-seqs", str(self.max_batch),
                "--seed", str(self.seed), "--enable-scale-out", "--logprobs-mode", c.logprobs_mode,
                "--served-model-name", "meshrl-policy", "--disable-uvicorn-access-log"]
        if self.stage is not None:
            args += ["--worker-extension-cls", WORKER_EXTENSION]
        args += list(c.extra_args)
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_gib)
        if c.omp_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = c.omp_threads_bind
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH", "")])])
        env.pop("VIRTUAL_ENV", None)
        log_file = c.log_file or (str(pathlib.Path(self.run_dir) / "vllm-server.log") if self.run_dir else "")
        if log_file:
            pathlib.Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(log_file, "ab")  # noqa: SIM115 - open for the server's lifetime
        else:
            import tempfile
            self._log_handle = tempfile.NamedTemporaryFile(prefix="meshrl-vllm-", suffix=".log", delete=False)
        self.log_path = self._log_handle.name
        self.url = f"http://{c.host}:{port}"
        self.log.info("vllm_starting", url=self.url, log=self.log_path, command=shlex.join(args))
        self.process = subprocess.Popen(args, cwd=str(ROOT), env=env, stdout=self._log_handle,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        started = time.monotonic()
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode} while starting "
                                   f"(see {getattr(self, 'log_path', 'its log')}): {self._log_tail()}")
            try:
                _get(self.url + "/health", 5.0)
                self.startup_seconds = time.monotonic() - started
                return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() >= deadline:
                self._kill()
                raise TimeoutError(f"vLLM server at {self.url} not healthy within {self.config.startup_timeout}s "
                                   f"(engine.vllm.startup_timeout): {self._log_tail()}")
            time.sleep(1.0)

    def _log_tail(self, n: int = 2000) -> str:
        path = getattr(self, "log_path", "")
        if not path:
            return ""
        with contextlib.suppress(OSError):
            return pathlib.Path(path).read_bytes()[-n:].decode(errors="replace")
        return ""

    def stop(self) -> None:
        """End every unfinished sequence with "abort", stop a server this engine started, drop the stage."""
        self._stopped = True
        for seq, live in list(self._live.items()):
            for task in (live.attempt, live.driver):
                if task is not None and not task.done():
                    task.cancel()
            self._finish(seq, "abort")
        self._live.clear()
        if self._client is not None and self._loop is not None and self._loop.is_running():
            client, self._client = self._client, None
            if _in_loop(self._loop):
                self._loop.create_task(client.aclose())
            else:
                asyncio.run_coroutine_threadsafe(client.aclose(), self._loop)
        self._kill()
        if self.stage is not None:
            self.stage.close()
            self.stage = None

    async def watch(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        """Until `stop`: raise when the server this engine started exits, or when a server (started or attached)
        fails /health three times in a row; the service then goes down and its supervisor restarts it."""
        failures = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set() or self._stopped:
                return
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode}: {self._log_tail(1000)}")
            try:
                await asyncio.to_thread(_get, self.url + "/health", 10.0)
                failures = 0
            except (OSError, urllib.error.URLError) as exc:
                failures += 1
                self.log.warning("vllm_unhealthy", url=self.url, failures=failures, error=str(exc))
                if failures >= 3:
                    raise RuntimeError(f"the vLLM server at {self.url} failed /health {failures} times") from exc

    def _kill(self) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    # the engine interface ---------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def max_context(self) -> int:
        return self._max_context

    def num_running(self) -> int:
        return sum(s.status is Status.RUNNING for s in self._live)

    def num_waiting(self) -> int:
        return sum(s.status is Status.WAITING for s in self._live)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        if self.stage is None:
            raise RuntimeError("engine.vllm.weight_updates is off (or the engine is not started): no weights to "
                               "write into")
        return dict(self.stage.tensors)

    def check(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> None:
        check_request(prompt_ids, sampling, n, max_context=self._max_context, vocab_size=self.vocab_size)

    def submit(self, prompt_ids: list[int], sampling: Sampling, on_finish=None, *, priority: bool = False) -> Sequence:
        """Admit one sequence (call on the event loop's thread)."""
        self.check(prompt_ids, sampling)
        if self._stopped:
            raise RuntimeError("engine stopped")
        self._bind_loop()
        seq = Sequence(prompt_ids=list(prompt_ids), sampling=sampling, on_finish=on_finish, priority=priority)
        live = _Live()
        self._live[seq] = live
        live.driver = self._loop.create_task(self._drive(seq, live), name=f"vllm-seq-{seq.seq_id}")
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stop `seq` (any thread): from the moment this returns its ids no longer change."""
        live = self._live.get(seq)
        if live is None or seq.status is Status.FINISHED:
            return
        live.aborted = True
        if self._loop is not None and not _in_loop(self._loop):
            self._loop.call_soon_threadsafe(self._abort_now, seq)
        else:
            self._abort_now(seq)

    def _abort_now(self, seq: Sequence) -> None:
        live = self._live.get(seq)
        if live is not None:
            for task in (live.attempt, live.driver):
                if task is not None and not task.done():
                    task.cancel()
        self._finish(seq, "abort")

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> list[Sequence]:
        self.check(prompt_ids, sampling, n)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        seqs = [self.submit(prompt_ids, sampling, lambda s, f=f: _resolve(f, s)) for f in futures]
        await asyncio.gather(*futures)
        return seqs

    # interruption -----------------------------------------------------------------------------------------------
    async def pause_async(self, timeout: float | None = None) -> None:
        """Stop sending, cancel what is in flight (those sequences resume later) and pause vLLM; pauses nest."""
        self._bind_loop()
        timeout = timeout or self.config.control_timeout
        async with self._control:
            self._pause_requests += 1
            if self._paused:
                return
            try:
                self._gate.clear()
                for live in self._live.values():
                    if live.attempt is not None and not live.attempt.done():
                        live.interrupted = True
                        live.attempt.cancel()
                await asyncio.wait_for(self._idle.wait(), timeout)
                await self._post("/pause", params={"mode": "abort", "clear_cache": "true"}, timeout=timeout)
            except BaseException:
                self._pause_requests -= 1
                if not self._pause_requests:
                    self._gate.set()
                raise
            self._paused = True

    async def resume_async(self, version: int | None = None) -> None:
        """Undo one pause; with a new `version`, vLLM loads the stage first and later tokens carry `version`."""
        self._bind_loop()
        async with self._control:
            failure: BaseException | None = None
            if version is not None and version != self.version:
                try:
                    await self._load_stage(version)
                except Exception as exc:  # noqa: BLE001 - resumed at the old version, then raised
                    self.log.warning("vllm_weight_load_failed", version=version, kept=self.version,
                                     error=f"{type(exc).__name__}: {exc}")
                    failure = exc
            self._pause_requests = max(0, self._pause_requests - 1)
            if not self._pause_requests and self._paused:
                await self._post("/resume", timeout=self.config.control_timeout)
                self._paused = False
                self._gate.set()
            if failure is not None:
                raise failure

    async def _load_stage(self, version: int) -> None:
        if self.stage is None:
            raise RuntimeError(f"engine.vllm.weight_updates is off: cannot load version {version}")
        if not self._paused:
            raise RuntimeError(f"load version {version}: the engine is not paused")
        started = time.monotonic()
        reply = await self._post("/collective_rpc", json_body={
            "method": "meshrl_load_staged", "args": [self.stage.manifest()],
            "timeout": self.config.control_timeout}, timeout=self.config.control_timeout)
        self.stats.weight_load_seconds += time.monotonic() - started
        self.stats.weight_updates += 1
        self.stats.interrupted_sequences += sum(live.interrupted for live in self._live.values())
        self.log.info("vllm_weights_loaded", version=version, result=(reply or {}).get("results"),
                      seconds=round(time.monotonic() - started, 3))
        self.version = version

    def pause(self, timeout: float = 60.0) -> None:
        """Blocking pause from another thread than the engine's event loop."""
        self._run_threadsafe(self.pause_async(timeout), timeout)

    def resume(self, version: int | None = None) -> None:
        self._run_threadsafe(self.resume_async(version), self.config.control_timeout)

    def _run_threadsafe(self, coro, timeout: float):
        if self._loop is None or _in_loop(self._loop):
            coro.close()
            raise RuntimeError("VLLMEngine.pause/resume block: call pause_async/resume_async on the event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout + 5)

    # HTTP --------------------------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is not loop or self._client is None:
            if self._loop is not None and self._loop is not loop and self._live:
                raise RuntimeError("VLLMEngine: used from a second event loop while sequences run")
            self._loop = loop
            limits = httpx.Limits(max_connections=self.config.max_connections,
                                  max_keepalive_connections=self.config.max_connections)
            self._client = httpx.AsyncClient(base_url=self.url, limits=limits,
                                             timeout=httpx.Timeout(self.config.request_timeout, connect=30.0))
            self._gate = asyncio.Event()
            if not self._paused:
                self._gate.set()
            self._idle = asyncio.Event()
            self._idle.set()
            self._control = asyncio.Lock()

    async def _post(self, path: str, *, params=None, json_body=None, timeout: float) -> dict | None:
        response = await self._client.post(path, params=params, json=json_body, timeout=timeout)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM {path}: HTTP {response.status_code}: {response.text[:500]}")
        if not response.content:
            return None
        with contextlib.suppress(ValueError):
            return response.json()
        return None

    async def _drive(self, seq: Sequence, live: _Live) -> None:
        """Send `seq` (again after each interruption) until it finishes."""
        try:
            while seq.status is not Status.FINISHED:
                await self._gate.wait()
                if seq.status is Status.FINISHED or live.aborted:
                    return
                remaining = min(seq.sampling.max_new_tokens - len(seq.output_ids),
                                self._max_context - len(seq.context))
                if remaining <= 0:
                    self._finish(seq, "length")
                    return
                live.interrupted = False
                seq.status = Status.RUNNING
                self._inflight += 1
                if self._inflight == 1:
                    self._idle.clear()
                    self._busy_since = time.monotonic()
                live.attempt = asyncio.ensure_future(self._stream(seq, live, remaining, self.version))
                try:
                    await asyncio.wait({live.attempt})
                finally:
                    self._inflight -= 1
                    if self._inflight == 0:
                        self.stats.busy_seconds += time.monotonic() - self._busy_since
                        self._idle.set()
                attempt, live.attempt = live.attempt, None
                if attempt is None or attempt.cancelled():
                    if live.interrupted and not live.aborted:
                        seq.status = Status.WAITING
                        continue  # a pause cut it: sent again after the resume, under the new version
                    self._finish(seq, "abort")
                    return
                error = attempt.exception()
                if error is not None:
                    # the request's own fault (HTTP 4xx, a malformed reply): "error", its work is dead-lettered;
                    # the server's (gone, restarting, 5xx): "abort", its work is redelivered
                    own = isinstance(error, _RequestRefused) and 400 <= error.status < 500
                    self.stats.steps_failed += 1
                    self.log.warning("vllm_request_failed", seq_id=seq.seq_id, error=f"{type(error).__name__}: {error}")
                    self._finish(seq, "error" if own else "abort")
                    return
                reason = attempt.result()
                if reason == "abort" and (live.interrupted or self._gate is not None and not self._gate.is_set()):
                    seq.status = Status.WAITING
                    continue  # vLLM aborted it for the pause before our cancel landed
                if reason in ("stop", "length"):
                    self._finish(seq, reason)
                elif reason == "abort":
                    self._finish(seq, "abort")
                elif reason:
                    self._finish(seq, "error" if reason == "error" else reason)
                else:
                    self.stats.steps_failed += 1
                    self._finish(seq, "error")
        except asyncio.CancelledError:
            self._finish(seq, "abort")
            raise
        finally:
            if seq.status is Status.FINISHED:
                self._live.pop(seq, None)

    async def _stream(self, seq: Sequence, live: _Live, max_tokens: int, version: int) -> str:
        """One streamed request for the rest of `seq`; returns vLLM's finish reason ("" if the stream ended early)."""
        s = seq.sampling
        body = {"token_ids": seq.context, "stream": True, "model": self.served_model, "output_mode": "tokens",
                "request_id": f"meshrl-{seq.seq_id}-{uuid.uuid4().hex[:8]}",
                "sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                                    "max_tokens": max_tokens, "stop_token_ids": list(s.stop_token_ids),
                                    "logprobs": 0, "detokenize": False, "skip_special_tokens": False}}
        self.stats.requests += 1
        async with self._client.stream("POST", "/inference/v1/generate", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                raise _RequestRefused(response.status_code, text)
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
                    if choice.get("finish_reason"):
                        return choice["finish_reason"]
        return ""

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.FINISHED:
            return
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.stats.sequences_finished += 1
        self.stats.sequences_aborted += reason == "abort"
        self.stats.sequences_failed += reason == "error"
        if seq.on_finish is not None:
            seq.on_finish(seq)


class _RequestRefused(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


@dataclasses.dataclass(eq=False)
class _Live:
    driver: asyncio.Task | None = None
    attempt: asyncio.Future | None = None
    aborted: bool = False        # the caller aborted it: never resent
    interrupted: bool = False    # a pause cut its request: resent after the resume


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the engine's own server
        return response.read().decode()


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the rollout process dies (even by SIGKILL), so no server
    outlives it (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
