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
  none         no updates (named_parameters() raises)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid

import httpx

from services.common.logging import get_logger
from services.rollout.engines.base import check_request
from services.rollout.engines.sequence import Sampling, Sequence, Status
from services.rollout.engines.vllm_engine import (
    ROOT,
    _die_with_parent,
    _eos_ids,
    _free_port,
    _in_loop,
    _Live,
    _RequestRefused,
    _resolve,
)

DTYPES = ("float32", "bfloat16")
WEIGHT_SYNCS = ("disk", "distributed", "none")
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
    weight_sync: str = "disk"        # disk | distributed | none: how new weights reach the server (see the module)
    weights_dir: str = ""            # disk: where checkpoints are written (the server reads them); empty: run_dir or a temp dir
    stage_dir: str = "/dev/shm"      # the stage's backing file (host memory)
    group_backend: str = "nccl"      # distributed: the process group's backend (nccl | gloo)
    group_address: str = "127.0.0.1"  # distributed: this host's address as the server's ranks reach it
    group_port: int = 0              # distributed: the rendezvous port here; 0: a free port
    log_file: str = ""               # a started server's output; empty: <run_dir>/sglang-server.log or a temp file

    def __post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine.sglang.url: must start with http:// or https://, got {self.url!r}")
        for name in ("port", "group_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"engine.sglang.{name}: must be in [0, 65535], got {getattr(self, name)}")
        if self.tp_size < 1:
            raise ValueError(f"engine.sglang.tp_size: must be >= 1, got {self.tp_size}")
        if not 0 <= self.mem_fraction_static < 1:
            raise ValueError(f"engine.sglang.mem_fraction_static: must be in [0, 1), got {self.mem_fraction_static}")
        for name in ("startup_timeout", "request_timeout", "control_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"engine.sglang.{name}: must be a positive number of seconds, got {value!r}")
        if self.max_connections < 1:
            raise ValueError(f"engine.sglang.max_connections: must be >= 1, got {self.max_connections}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"engine.sglang.weight_sync: must be one of {', '.join(WEIGHT_SYNCS)}, "
                             f"got {self.weight_sync!r}")
        if self.group_backend not in GROUP_BACKENDS:
            raise ValueError(f"engine.sglang.group_backend: must be one of {', '.join(GROUP_BACKENDS)}, "
                             f"got {self.group_backend!r}")
        if not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError("engine.sglang.extra_args: must be strings")

    def build(self, *, model_path: str, max_batch: int, max_context: int, dtype: str = "float32", seed: int = 0,
              version: int = 0, run_dir: str = "") -> SGLangEngine:
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
        return SGLangEngine(self, model_path=str(model), max_batch=max_batch, max_context=max_context, dtype=dtype,
                            seed=seed, version=version, vocab_size=int(vocab) if vocab else None,
                            eos_token_ids=_eos_ids(model, config), run_dir=run_dir)


@dataclasses.dataclass
class SGLangStats:
    tokens_generated: int = 0
    sequences_finished: int = 0
    weight_updates: int = 0
    interrupted_sequences: int = 0
    sequences_aborted: int = 0
    sequences_failed: int = 0
    steps_failed: int = 0            # requests the server failed (HTTP errors, malformed replies)
    steps: int = 0                   # /generate replies read
    busy_seconds: float = 0.0        # wall seconds with at least one request in flight
    requests: int = 0                # /generate requests sent (a resumed sequence sends another)
    weight_load_seconds: float = 0.0


class SGLangEngine:
    kind = "sglang"

    def __init__(self, config: SGLangConfig, *, model_path: str, max_batch: int, max_context: int, dtype: str,
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
        self.stats = SGLangStats()
        self.url = config.url.rstrip("/")
        self.process: subprocess.Popen | None = None
        self.stage = None
        self.group = None
        self.model_info: dict = {}
        self.server_info: dict = {}
        self.log = get_logger().bind(engine="sglang")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._live: dict[Sequence, _Live] = {}
        self._gate: asyncio.Event | None = None       # set while requests may be sent
        self._idle: asyncio.Event | None = None       # set while no request is in flight
        self._control: asyncio.Lock | None = None     # one pause / resume at a time
        self._inflight = 0
        self._busy_since = 0.0
        self._pause_requests = 0
        self._paused = False
        self._stopped = False
        self._log_handle = None
        self.log_path = ""

    # lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start (or attach to) the server, wait until it answers, read what it reports, and join the weight
        group (distributed). Blocking: call before serving."""
        import torch

        from services.rollout.engines.vllm_engine import Stage

        if self.config.weight_sync != "none" and self.stage is None:
            self.stage = Stage(self.model_path, getattr(torch, self.dtype), self.config.stage_dir)
        if not self.url:
            self._launch()
        self._wait_healthy()
        self.model_info = self._get_json("/get_model_info")
        self.server_info = self._server_info()
        if self.config.weight_sync == "distributed":
            self._join_group()
        self.log.info("sglang_ready", url=self.url, model=self.model_info.get("model_path"), version=self.version,
                      server_version=self.server_info.get("version"), tp_size=self.server_info.get("tp_size"),
                      weight_sync=self.config.weight_sync, started=self.process is not None)

    def _launch(self) -> None:
        c = self.config
        port = c.port or _free_port(c.host)
        python = pathlib.Path(c.python) if c.python else pathlib.Path(sys.executable)
        if not python.is_absolute():
            python = ROOT / python
        if not python.exists():
            raise RuntimeError(f"engine.sglang.python: {python} does not exist")
        args = [str(python), "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", c.host,
                "--port", str(port), "--dtype", self.dtype, "--context-length", str(self._max_context),
                "--max-running-requests", str(self.max_batch), "--random-seed", str(self.seed),
                "--tp-size", str(c.tp_size), "--served-model-name", "meshrl-policy"]
        if c.mem_fraction_static:
            args += ["--mem-fraction-static", str(c.mem_fraction_static)]
        args += list(c.extra_args)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH", "")])])
        log_file = c.log_file or (str(pathlib.Path(self.run_dir) / "sglang-server.log") if self.run_dir else "")
        if log_file:
            pathlib.Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(log_file, "ab")  # noqa: SIM115 - open for the server's lifetime
        else:
            self._log_handle = tempfile.NamedTemporaryFile(prefix="meshrl-sglang-", suffix=".log", delete=False)
        self.log_path = self._log_handle.name
        self.url = f"http://{c.host}:{port}"
        self.log.info("sglang_starting", url=self.url, log=self.log_path, command=shlex.join(args))
        self.process = subprocess.Popen(args, cwd=str(ROOT), env=env, stdout=self._log_handle,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.process.returncode} while starting "
                                   f"(see {self.log_path}): {self._log_tail()}")
            try:
                _request("GET", self.url + "/health", None, min(5.0, self.config.connect_timeout))
                return
            except (OSError, urllib.error.URLError, RuntimeError):
                pass
            if time.monotonic() >= deadline:
                self._kill()
                raise TimeoutError(f"SGLang server at {self.url} not healthy within {self.config.startup_timeout}s "
                                   f"(engine.sglang.startup_timeout): {self._log_tail()}")
            time.sleep(0.5)

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
        port = c.group_port or _free_port(c.group_address)
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

    def _log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return pathlib.Path(self.log_path).read_bytes()[-n:].decode(errors="replace") if self.log_path else ""
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
        if self.group is not None:
            from services.rollout.engines.sglang_weights import close_group

            close_group(self.group)
            self.group = None
        self._kill()
        if self.stage is not None:
            self.stage.close()
            self.stage = None

    async def watch(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        """Until `stop`: raise when a started server exits, or when the server fails /health three times in a row."""
        failures = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set() or self._stopped:
                return
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the SGLang server exited with {self.process.returncode}: {self._log_tail(1000)}")
            try:
                await asyncio.to_thread(_request, "GET", self.url + "/health", None, 20.0)
                failures = 0
            except (OSError, urllib.error.URLError, RuntimeError) as exc:
                failures += 1
                self.log.warning("sglang_unhealthy", url=self.url, failures=failures, error=str(exc))
                if failures >= 3:
                    raise RuntimeError(f"the SGLang server at {self.url} failed /health {failures} times") from exc

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

    def named_parameters(self):
        if self.stage is None:
            raise RuntimeError("engine.sglang.weight_sync is none (or the engine is not started): no weights to "
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
        live.driver = self._loop.create_task(self._drive(seq, live), name=f"sglang-seq-{seq.seq_id}")
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
            rid = getattr(live, "rid", "")
            if rid and self._client is not None:  # frees the server's slot; the reply no longer matters
                self._loop.create_task(self._tell_abort(rid))
            for task in (live.attempt, live.driver):
                if task is not None and not task.done():
                    task.cancel()
        self._finish(seq, "abort")

    async def _tell_abort(self, rid: str) -> None:
        try:
            await self._post("/abort_request", {"rid": rid}, timeout=self.config.control_timeout)
        except Exception as exc:  # noqa: BLE001 - the sequence has ended here either way
            self.log.warning("sglang_abort_request_failed", rid=rid, error=f"{type(exc).__name__}: {exc}")

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> list[Sequence]:
        self.check(prompt_ids, sampling, n)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        seqs = [self.submit(prompt_ids, sampling, lambda s, f=f: _resolve(f, s)) for f in futures]
        await asyncio.gather(*futures)
        return seqs

    # interruption -----------------------------------------------------------------------------------------------
    async def pause_async(self, timeout: float | None = None) -> None:
        """Stop sending, have the server abort what is in flight (those sequences resume later); pauses nest."""
        self._bind_loop()
        timeout = timeout or self.config.control_timeout
        async with self._control:
            self._pause_requests += 1
            if self._paused:
                return
            try:
                self._gate.clear()
                await self._post("/pause_generation", {"mode": "abort"}, timeout=timeout)
                try:
                    await asyncio.wait_for(self._idle.wait(), min(PAUSE_GRACE, timeout))
                except TimeoutError:
                    for live in self._live.values():  # sent as the pause began: the server holds it, we drop it
                        if live.attempt is not None and not live.attempt.done():
                            live.interrupted = True
                            live.attempt.cancel()
                    await asyncio.wait_for(self._idle.wait(), timeout)
            except BaseException:
                self._pause_requests -= 1
                if not self._pause_requests:
                    with contextlib.suppress(Exception):
                        await self._post("/continue_generation", {}, timeout=self.config.connect_timeout)
                    self._gate.set()
                raise
            self._paused = True

    async def resume_async(self, version: int | None = None) -> None:
        """Undo one pause; with a new `version`, the server loads the stage first and later tokens carry it."""
        self._bind_loop()
        async with self._control:
            failure: BaseException | None = None
            if version is not None and version != self.version:
                try:
                    await self._load_weights(version)
                except Exception as exc:  # noqa: BLE001 - resumed at the old version, then raised
                    self.log.warning("sglang_weight_load_failed", version=version, kept=self.version,
                                     error=f"{type(exc).__name__}: {exc}")
                    failure = exc
            self._pause_requests = max(0, self._pause_requests - 1)
            if not self._pause_requests and self._paused:
                await self._post("/continue_generation", {}, timeout=self.config.control_timeout)
                self._paused = False
                self._gate.set()
            if failure is not None:
                raise failure

    async def _load_weights(self, version: int) -> None:
        if self.stage is None:
            raise RuntimeError(f"engine.sglang.weight_sync is none: cannot load version {version}")
        if not self._paused:
            raise RuntimeError(f"load version {version}: the engine is not paused")
        started = time.monotonic()
        timeout = self.config.control_timeout
        if self.config.weight_sync == "disk":
            from services.rollout.engines.sglang_weights import write_checkpoint

            path = await asyncio.to_thread(write_checkpoint, self.stage.tensors, self.model_path, self._weights_dir(),
                                           version)
            reply = await self._post("/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "flush_cache": True}, timeout=timeout)
        else:
            reply = await self._broadcast(version)
        if not (reply or {}).get("success", False):
            raise RuntimeError(f"SGLang weight update to version {version} failed: {reply}")
        self.stats.weight_load_seconds += time.monotonic() - started
        self.stats.weight_updates += 1
        self.stats.interrupted_sequences += sum(live.interrupted or s.status is Status.WAITING
                                                for s, live in self._live.items())
        self.log.info("sglang_weights_loaded", version=version, sync=self.config.weight_sync,
                      seconds=round(time.monotonic() - started, 3))
        self.version = version

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

    # HTTP --------------------------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is not loop or self._client is None:
            if self._loop is not None and self._loop is not loop and self._live:
                raise RuntimeError("SGLangEngine: used from a second event loop while sequences run")
            self._loop = loop
            c = self.config
            limits = httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections)
            self._client = httpx.AsyncClient(base_url=self.url, limits=limits,
                                             timeout=httpx.Timeout(c.request_timeout, connect=c.connect_timeout))
            self._gate = asyncio.Event()
            if not self._paused:
                self._gate.set()
            self._idle = asyncio.Event()
            self._idle.set()
            self._control = asyncio.Lock()

    async def _post(self, path: str, body: dict, *, timeout: float) -> dict | None:
        response = await self._client.post(path, json=body,
                                           timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout))
        if response.status_code != 200:
            raise RuntimeError(f"SGLang {path}: HTTP {response.status_code}: {response.text[:500]}")
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
                live.attempt = asyncio.ensure_future(self._generate_once(seq, live, remaining, self.version))
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
                        continue
                    self._finish(seq, "abort")
                    return
                error = attempt.exception()
                if error is not None:
                    # the request's own fault (HTTP 4xx, a malformed reply): "error", its work is dead-lettered;
                    # the server's (gone, 5xx, a timeout): "abort", its work is redelivered
                    own = isinstance(error, _RequestRefused | _Malformed) and getattr(error, "status", 400) < 500
                    self.stats.steps_failed += 1
                    self.log.warning("sglang_request_failed", seq_id=seq.seq_id, error=f"{type(error).__name__}: {error}")
                    self._finish(seq, "error" if own else "abort")
                    return
                reason = attempt.result()
                if reason == "abort" and not live.aborted and not self._gate.is_set():
                    seq.status = Status.WAITING
                    continue  # /pause_generation ended it: its tokens are kept, the rest is asked for after resume
                self._finish(seq, reason if reason in ("stop", "length", "abort") else "error")
        except asyncio.CancelledError:
            self._finish(seq, "abort")
            raise
        finally:
            if seq.status is Status.FINISHED:
                self._live.pop(seq, None)

    async def _generate_once(self, seq: Sequence, live: _Live, max_tokens: int, version: int) -> str:
        """One /generate for the rest of `seq`; appends what it returns; returns the finish reason type."""
        s = seq.sampling
        live.rid = f"meshrl-{seq.seq_id}-{uuid.uuid4().hex[:8]}"
        body = {"input_ids": seq.context, "rid": live.rid, "stream": False, "return_logprob": True,
                "logprob_start_len": -1, "top_logprobs_num": 0,
                "sampling_params": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
                                    "max_new_tokens": max_tokens, "stop_token_ids": list(s.stop_token_ids),
                                    "skip_special_tokens": False}}
        self.stats.requests += 1
        response = await self._client.post("/generate", json=body)
        if response.status_code != 200:
            raise _RequestRefused(response.status_code, response.text[:500])
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
