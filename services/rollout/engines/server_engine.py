"""An inference server in another process behind the rollout's engine interface: what the vLLM and SGLang engines
share.

`ServerEngine` starts the server as a subprocess (or attaches to one by URL), watches its health and stops it; it
keeps one `LiveRequest` record per sequence and drives each sequence as a series of requests, sent only while the gate is
open (not paused) and tagged with the version loaded when sent. A sequence a pause cuts short waits at the gate and
is sent again after the resume for the tokens it still lacks.

The extension interface (what vLLM, vLLM-Ascend and SGLang implement; a new server engine does the same):

- must set `kind`, `name` (the config section and the log events' prefix), `server_name` (for messages),
  `weights_off` (the setting that turned weight updates off);
- must start its server (or attach to one by URL) when built, and implement `_send(seq, live, max_tokens,
  version)` (one request for the rest of a sequence: the finish reason), `_pause_server` / `_resume_server` and
  `_send_weights(version)`;
- may override `_outcome` (what a finish reason means), `_ping` / `_startup_ping_timeout` (health),
  `_tell_server_aborted` (an abort the server must hear of), `_close_weight_channel`, `_count_interrupted`,
  `_undo_failed_pause` and `_control_timeout`.

The hooks keep their leading underscore because the rollout service never calls them: it sees the `Engine`
protocol only. Inheritance rather than composition because every hook runs inside the base's one request loop and
gate, which a subclass must not reimplement. The helpers a subclass uses are public: `LiveRequest`,
`RequestRefused`, `http_get`, `read_json`, `engine_args`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

import httpx

from services.common.errors import FieldError
from services.common.logging import get_logger
from services.common.runtime import sleep_or_stop
from services.rollout.engines.base import EngineStats, check_request
from services.rollout.engines.sequence import Sampling, Sequence, Status

DTYPES = ("float32", "bfloat16")
ROOT = pathlib.Path(__file__).resolve().parents[3]


def engine_args(*, model_path: str, max_batch: int, max_context: int, dtype: str, seed: int, version: int,
                run_dir: str) -> dict:
    """The engine section's checks and what the model directory says: the keyword arguments of a ServerEngine."""
    if dtype not in DTYPES:
        raise FieldError("engine.dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if max_batch < 1:
        raise FieldError("engine.max_batch", f"must be >= 1, got {max_batch}")
    if max_context < 2:
        raise FieldError("engine.max_context", f"must be >= 2, got {max_context}")
    model = pathlib.Path(model_path)
    if not (model / "config.json").is_file():
        raise FieldError("engine.model_path", f"{model_path!r} is not a Hugging Face model directory (config.json)")
    config = json.loads((model / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return dict(model_path=str(model), max_batch=max_batch, max_context=max_context, dtype=dtype, seed=seed,
                version=version, vocab_size=int(vocab) if vocab else None, eos_token_ids=_eos_ids(model, config),
                run_dir=run_dir)


@dataclasses.dataclass
class ServerStats(EngineStats):
    requests: int = 0                # generation requests sent (a resumed sequence sends another)
    weight_load_seconds: float = 0.0


class ServerEngine:
    name = ""                  # the config section (engine.<name>) and the log events' prefix
    server_name = ""           # the server in messages
    weights_off = ""           # the setting that turned weight updates off, for messages
    connect_timeout = 30.0     # seconds to open a connection to the server
    startup_poll = 1.0         # seconds between /health tries while the server starts
    watch_ping_timeout = 10.0  # seconds for one /health of watch()
    failure: str | None = None  # a server's death takes the service down through watch(); never set here

    def __init__(self, config, *, model_path: str, max_batch: int, max_context: int, dtype: str, seed: int,
                 version: int, vocab_size: int | None, eos_token_ids: tuple[int, ...], run_dir: str = "") -> None:
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
        self.stats = ServerStats()
        self.url = config.url.rstrip("/")
        self.process: subprocess.Popen | None = None
        self.stage = None
        self.log = get_logger().bind(engine=self.name)
        self.log_path = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._live: dict[Sequence, LiveRequest] = {}
        self._gate: asyncio.Event | None = None       # set while requests may be sent
        self._idle: asyncio.Event | None = None       # set while no request is in flight
        self._control: asyncio.Lock | None = None     # one pause / resume at a time
        self._inflight = 0
        self._busy_since = 0.0
        self._pause_requests = 0
        self._paused = False
        self._stopped = False
        self._log_handle = None

    # the server's process ---------------------------------------------------------------------------------------
    def _server_python(self, python: str, hint: str = "") -> pathlib.Path:
        path = pathlib.Path(python)
        if not path.is_absolute():
            path = ROOT / path
        if not path.exists():
            raise RuntimeError(f"engine.{self.name}.python: {path} does not exist{hint}")
        return path

    @staticmethod
    def _server_env() -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH", "")])])
        return env

    def _spawn(self, args: list[str], env: dict[str, str], host: str, port: int) -> None:
        """Start the server (its output to the log file) and point the engine at it."""
        import shlex

        configured = self.config.log_file
        log_file = configured or (str(pathlib.Path(self.run_dir) / f"{self.name}-server.log") if self.run_dir else "")
        if log_file:
            pathlib.Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(log_file, "ab")  # noqa: SIM115 - open for the server's lifetime
        else:
            self._log_handle = tempfile.NamedTemporaryFile(prefix=f"meshrl-{self.name}-", suffix=".log", delete=False)
        self.log_path = self._log_handle.name
        self.url = f"http://{host}:{port}"
        self.log.info(f"{self.name}_starting", url=self.url, log=self.log_path, command=shlex.join(args))
        self.process = subprocess.Popen(args, cwd=str(ROOT), env=env, stdout=self._log_handle,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_die_with_parent)

    def _ping(self, timeout: float) -> None:
        """GET /health; raises when the server does not answer it."""
        http_get(self.url + "/health", timeout)

    def _startup_ping_timeout(self) -> float:
        return 5.0

    def _wait_healthy(self) -> None:
        started = time.monotonic()
        deadline = started + self.config.startup_timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.server_name} server exited with {self.process.returncode} while starting "
                                   f"(see {self.log_path or 'its log'}): {self._log_tail()}")
            try:
                self._ping(self._startup_ping_timeout())
                self.startup_seconds = time.monotonic() - started
                return
            except (OSError, urllib.error.URLError, RuntimeError):
                pass
            if time.monotonic() >= deadline:
                self._kill()
                raise TimeoutError(f"{self.server_name} server at {self.url} not healthy within "
                                   f"{self.config.startup_timeout}s (engine.{self.name}.startup_timeout): "
                                   f"{self._log_tail()}")
            time.sleep(self.startup_poll)

    def _log_tail(self, n: int = 2000) -> str:
        if not self.log_path:
            return ""
        with contextlib.suppress(OSError):
            return pathlib.Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
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
        self._close_weight_channel()
        self._kill()
        if self.stage is not None:
            self.stage.close()
            self.stage = None

    def _close_weight_channel(self) -> None:
        """Called by stop() before the server goes: release what connects this process to the server's weights."""

    async def watch(self, stop: asyncio.Event, interval: float = 5.0) -> None:
        """Until `stop`: raise when the server this engine started exits, or when a server (started or attached)
        fails /health three times in a row; the service then goes down and its supervisor restarts it."""
        failures = 0
        while not stop.is_set():
            if await sleep_or_stop(stop, interval) or self._stopped:
                return
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"the {self.server_name} server exited with {self.process.returncode}: "
                                   f"{self._log_tail(1000)}")
            try:
                await asyncio.to_thread(self._ping, self.watch_ping_timeout)
                failures = 0
            except (OSError, urllib.error.URLError, RuntimeError) as exc:
                failures += 1
                self.log.warning(f"{self.name}_unhealthy", url=self.url, failures=failures, error=str(exc))
                if failures >= 3:
                    raise RuntimeError(f"the {self.server_name} server at {self.url} failed /health "
                                       f"{failures} times") from exc

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

    def named_parameters(self) -> dict:
        if self.stage is None:
            raise RuntimeError(f"{self.weights_off} (or the engine is not started): no weights to write into")
        return dict(self.stage.tensors)

    def weight_receiver_args(self) -> dict[str, Any]:
        return {"params": self.named_parameters()}

    def check(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> None:
        check_request(prompt_ids, sampling, n, max_context=self._max_context, vocab_size=self.vocab_size)

    def submit(self, prompt_ids: list[int], sampling: Sampling, on_finish=None, *, priority: bool = False) -> Sequence:
        """Admit one sequence (call on the event loop's thread)."""
        self.check(prompt_ids, sampling)
        if self._stopped:
            raise RuntimeError("engine stopped")
        self._bind_loop()
        seq = Sequence(prompt_ids=list(prompt_ids), sampling=sampling, on_finish=on_finish, priority=priority)
        live = LiveRequest()
        self._live[seq] = live
        live.driver = self._loop.create_task(self._drive(seq, live), name=f"{self.name}-seq-{seq.seq_id}")
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
            self._tell_server_aborted(live)
            for task in (live.attempt, live.driver):
                if task is not None and not task.done():
                    task.cancel()
        self._finish(seq, "abort")

    def _tell_server_aborted(self, live: LiveRequest) -> None:
        """Called (on the loop) when the caller aborts a sequence, before its request is cancelled."""

    async def generate(self, prompt_ids: list[int], sampling: Sampling, n: int = 1) -> list[Sequence]:
        self.check(prompt_ids, sampling, n)
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        seqs = [self.submit(prompt_ids, sampling, lambda s, f=f: _resolve(f, s)) for f in futures]
        await asyncio.gather(*futures)
        return seqs

    # interruption -----------------------------------------------------------------------------------------------
    async def pause_async(self, timeout: float | None = None) -> None:
        """Stop sending, end what is in flight (those sequences resume later) and pause the server; pauses nest."""
        self._bind_loop()
        timeout = timeout or self.config.control_timeout
        async with self._control:
            self._pause_requests += 1
            if self._paused:
                return
            try:
                self._gate.clear()
                await self._pause_server(timeout)
            except BaseException:
                self._pause_requests -= 1
                if not self._pause_requests:
                    await self._undo_failed_pause()
                    self._gate.set()
                raise
            self._paused = True

    async def _pause_server(self, timeout: float) -> None:
        """With the gate closed: end every request in flight (`_idle` set once they are back), pause the server."""
        raise NotImplementedError

    async def _undo_failed_pause(self) -> None:
        """A pause failed half-way: let the server generate again."""

    def _interrupt_in_flight(self) -> None:
        """Cancel every request in flight; its sequence is sent again after the resume."""
        for live in self._live.values():
            if live.attempt is not None and not live.attempt.done():
                live.interrupted = True
                live.attempt.cancel()

    async def resume_async(self, version: int | None = None) -> None:
        """Undo one pause; with a new `version`, the server loads the stage first and later tokens carry it."""
        self._bind_loop()
        async with self._control:
            failure: BaseException | None = None
            if version is not None and version != self.version:
                try:
                    await self._load_weights(version)
                except Exception as exc:  # noqa: BLE001 - resumed at the old version, then raised
                    self.log.warning(f"{self.name}_weight_load_failed", version=version, kept=self.version,
                                     error=f"{type(exc).__name__}: {exc}")
                    failure = exc
            self._pause_requests = max(0, self._pause_requests - 1)
            if not self._pause_requests and self._paused:
                await self._resume_server()
                self._paused = False
                self._gate.set()
            if failure is not None:
                raise failure

    async def _resume_server(self) -> None:
        raise NotImplementedError

    def _holds_weights(self) -> bool:
        """Whether updates can reach the server (the stage exists)."""
        return self.stage is not None

    async def _load_weights(self, version: int) -> None:
        if not self._holds_weights():
            raise RuntimeError(f"{self.weights_off}: cannot load version {version}")
        if not self._paused:
            raise RuntimeError(f"load version {version}: the engine is not paused")
        started = time.monotonic()
        details = await self._send_weights(version)
        self.stats.weight_load_seconds += time.monotonic() - started
        self.stats.weight_updates += 1
        self.stats.interrupted_sequences += self._count_interrupted()
        self.log.info(f"{self.name}_weights_loaded", version=version, **details,
                      seconds=round(time.monotonic() - started, 3))
        self.version = version

    async def _send_weights(self, version: int) -> dict:
        """Have the server load the stage as `version`; returns fields for the log event."""
        raise NotImplementedError

    def _count_interrupted(self) -> int:
        return sum(live.interrupted for live in self._live.values())

    def pause(self, timeout: float = 60.0) -> None:
        """Blocking pause from another thread than the engine's event loop."""
        self._run_threadsafe(self.pause_async(timeout), timeout)

    def resume(self, version: int | None = None) -> None:
        self._run_threadsafe(self.resume_async(version), self.config.control_timeout)

    def _run_threadsafe(self, coro, timeout: float):
        if self._loop is None or _in_loop(self._loop):
            coro.close()
            raise RuntimeError(f"{type(self).__name__}.pause/resume block: call pause_async/resume_async on the "
                               "event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout + 5)

    # HTTP --------------------------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is not loop or self._client is None:
            if self._loop is not None and self._loop is not loop and self._live:
                raise RuntimeError(f"{type(self).__name__}: used from a second event loop while sequences run")
            self._loop = loop
            connections = self.config.max_connections
            limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
            self._client = httpx.AsyncClient(base_url=self.url, limits=limits,
                                             timeout=httpx.Timeout(self.config.request_timeout,
                                                                   connect=self.connect_timeout))
            self._gate = asyncio.Event()
            if not self._paused:
                self._gate.set()
            self._idle = asyncio.Event()
            self._idle.set()
            self._control = asyncio.Lock()

    def _control_timeout(self, timeout: float) -> float | httpx.Timeout:
        """The httpx timeout of a control request (pause, resume, weights) that may take `timeout` seconds."""
        return timeout

    async def _post(self, path: str, body: dict | None = None, *, params=None, timeout: float) -> dict | None:
        response = await self._client.post(path, params=params, json=body, timeout=self._control_timeout(timeout))
        if response.status_code != 200:
            raise RuntimeError(f"{self.server_name} {path}: HTTP {response.status_code}: {response.text[:500]}")
        with contextlib.suppress(ValueError):
            return response.json()
        return None

    async def _drive(self, seq: Sequence, live: LiveRequest) -> None:
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
                live.attempt = asyncio.ensure_future(self._send(seq, live, remaining, self.version))
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
                    # the server's (gone, restarting, 5xx, a timeout): "abort", its work is redelivered
                    self.stats.steps_failed += 1
                    self.log.warning(f"{self.name}_request_failed", seq_id=seq.seq_id,
                                     error=f"{type(error).__name__}: {error}")
                    self._finish(seq, "error" if self._own_fault(error) else "abort")
                    return
                outcome = self._outcome(attempt.result(), live)
                if outcome is None:
                    seq.status = Status.WAITING
                    continue
                self._finish(seq, outcome)
        except asyncio.CancelledError:
            self._finish(seq, "abort")
            raise
        finally:
            if seq.status is Status.FINISHED:
                self._live.pop(seq, None)

    async def _send(self, seq: Sequence, live: LiveRequest, max_tokens: int, version: int) -> str:
        """One request for the rest of `seq` (at most `max_tokens`), its tokens tagged `version`; its finish reason."""
        raise NotImplementedError

    def _own_fault(self, error: BaseException) -> bool:
        return isinstance(error, RequestRefused) and 400 <= error.status < 500

    def _outcome(self, reason: str, live: LiveRequest) -> str | None:
        """How a sequence whose request ended with `reason` finishes; None: a pause ended it, send it again."""
        raise NotImplementedError

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


class RequestRefused(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


@dataclasses.dataclass(eq=False)
class LiveRequest:
    driver: asyncio.Task | None = None
    attempt: asyncio.Future | None = None
    aborted: bool = False        # the caller aborted it: never resent
    interrupted: bool = False    # a pause cut its request: resent after the resume
    rid: str = ""                # the server's id of the request in flight, where the server takes one


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def http_get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the engine's own server
        return response.read().decode()


def http_post_json(url: str, body: dict, timeout: float) -> Any:
    """POST `body` as JSON (blocking; before the engine's event loop runs), the reply's JSON."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the engine's own server
        return json.loads(response.read().decode())


def _eos_ids(model: pathlib.Path, config: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (config, read_json(model / "generation_config.json")):
        value = source.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return tuple(dict.fromkeys(ids))


def read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the rollout process dies (even by SIGKILL), so no server
    outlives it (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


