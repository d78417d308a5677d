"""Local processes: every child the launcher starts (`popen`: it dies with the launcher), real nats-servers
with JetStream (one, or a three-node cluster), free ports."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from services.common.errors import FieldError
from services.common.net import free_port

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_CHILDREN: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()  # every process popen() started


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: the kernel SIGKILLs it when the thread that forked it ends (the launcher's
    main thread or the forker thread, both as long as the process). If the launcher died between fork and
    prctl the signal will never come: the child was reparented already, so it ends itself."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


class _Forker:
    """One daemon thread that lives as long as the process and starts the children asked for from other threads:
    PR_SET_PDEATHSIG fires when the forking *thread* ends, so a child started from the supervisor's restart
    thread would be killed when supervision stops (before its graceful SIGTERM)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], subprocess.Popen], timeout: float = 60.0) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="launcher-forker", daemon=True)
                self._thread.start()
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, done))
        try:
            ok, value = done.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the forker thread did not start the process within {timeout}s") from None
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.put((True, fn()))
            except BaseException as exc:  # handed to the caller
                done.put((False, exc))


_FORKER = _Forker()


def popen(args: Sequence[str], *, detach: bool = False, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` for a process of the run: it dies with this process, even when this one is SIGKILLed
    (Linux: PR_SET_PDEATHSIG), and runs in a process group of its own, so a terminal's Ctrl-C reaches only the
    launcher, which stops its children in order (rollout first, NATS last); `detach`: a session of its own (the
    `make up` supervisor's children: no terminal at all). `kill_children()` ends them all at once."""
    parent = os.getpid()
    if detach:
        kwargs["start_new_session"] = True
    else:
        kwargs["process_group"] = 0
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = lambda: _die_with_parent(parent)

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(list(args), **kwargs)
        _CHILDREN.add(proc)
        return proc

    return start() if threading.current_thread() is threading.main_thread() else _FORKER.call(start)


def terminate_all(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every process still running, SIGKILL (and reap) what is left after `timeout` s: one deadline for all."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def kill_children() -> list[int]:
    """SIGKILL every live process popen() started, with its process group (a service's own children); the pids."""
    killed = []
    for proc in list(_CHILDREN):
        if proc.returncode is not None:
            continue
        for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):  # the group is the child's own pid
            try:
                kill(target, signal.SIGKILL)
            except OSError:
                pass
        killed.append(proc.pid)
    return killed


def nats_server_binary() -> str:
    return str(pathlib.Path(sys.executable).parent / "nats-server")


class NatsServer:
    """A real nats-server with JetStream on a loopback port (a free one unless given).

    With `cluster_port` it is one node of a cluster: `server_name`, `cluster_name` and `routes` (the other
    nodes' cluster URLs) go on its command line. `spawn()` starts the process without waiting (what a
    supervisor restarts), `start()` also waits until it accepts connections. Output goes to `log_path`
    (appended) when given.

    With `authorization` (a nats-server authorization block: users and their permissions) the server runs from
    a config file written at `config_path` (mode 0600: it holds passwords) on every spawn, and `route_auth`
    (user, password) protects the cluster routes; without it, from command-line flags, open to anyone.
    """

    def __init__(self, store: pathlib.Path, port: int | None = None, *, log_path: pathlib.Path | None = None,
                 server_name: str = "", cluster_name: str = "", cluster_port: int | None = None,
                 routes: Sequence[str] = (), authorization: dict | None = None,
                 config_path: pathlib.Path | None = None, route_auth: tuple[str, str] | None = None) -> None:
        if authorization is not None and config_path is None:
            raise FieldError("config_path", "required with authorization")
        self.store = store
        self.authorization = authorization
        self.config_path = config_path
        self.route_auth = route_auth
        self.port = port or free_port()
        self.log_path = log_path
        self.server_name = server_name
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.proc: subprocess.Popen | None = None
        self.detach = False  # a session of its own (the `make up` supervisor's; it still dies with its parent)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.authorization is not None:
            return [nats_server_binary(), "-c", str(self.config_path)]
        cmd = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        if self.server_name:
            cmd += ["--server_name", self.server_name]
        if self.cluster_port is not None:
            cmd += ["--cluster_name", self.cluster_name or "meshrl", "--cluster",
                    f"nats://127.0.0.1:{self.cluster_port}"]
            if self.routes:
                cmd += ["--routes", ",".join(self.routes)]
        return cmd

    def config(self) -> dict:
        """The server's configuration file (JSON is valid nats-server syntax) when it runs with authorization."""
        conf: dict = {"listen": f"127.0.0.1:{self.port}", "jetstream": {"store_dir": str(self.store)},
                      "authorization": self.authorization}
        if self.server_name:
            conf["server_name"] = self.server_name
        if self.cluster_port is not None:
            cluster: dict = {"name": self.cluster_name or "meshrl", "listen": f"127.0.0.1:{self.cluster_port}",
                             "routes": list(self.routes)}
            if self.route_auth is not None:
                user, password = self.route_auth
                cluster["authorization"] = {"user": user, "password": password}
                cluster["routes"] = [r.replace("nats://", f"nats-route://{user}:{password}@", 1) for r in self.routes]
            conf["cluster"] = cluster
        return conf

    def write_config(self) -> None:
        assert self.config_path is not None
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.config_path.with_name(f".{self.config_path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.config(), f, indent=1)
        os.replace(tmp, self.config_path)

    def spawn(self) -> subprocess.Popen:
        """Start the process (same port, store and log every time) and return it, without waiting."""
        self.store.mkdir(parents=True, exist_ok=True)
        if self.authorization is not None:
            self.write_config()
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self.proc = popen(self.command(), stdout=log, stderr=subprocess.STDOUT, detach=self.detach)
        else:
            self.proc = popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              detach=self.detach)
        return self.proc

    def start(self, timeout: float = 10.0) -> None:
        self.spawn()
        self.wait_listening(timeout)

    def wait_listening(self, timeout: float = 10.0) -> None:
        """Until the client port accepts connections; raises when the process died or the time ran out."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not start listening on {self.port} within {timeout}s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class NatsCluster:
    """Three (or `size`) real nats-servers with JetStream in one cluster `meshrl`, each with its own store.

    `url` is the comma-separated list of the client URLs (what services take as `nats_url`). `start()` returns
    once the meta leader sees every node online (a stream replicated on all of them can be placed); `kill(i)`
    and `start_node(i)` stop and bring back one node.
    `authorization`, `config_dir` (node i's file: `nats-n<i>.conf`), `route_auth` and `connect_options` (for the
    readiness probe): as for NatsServer.
    """

    def __init__(self, store: pathlib.Path, ports: Sequence[int] | None = None,
                 cluster_ports: Sequence[int] | None = None, *, size: int = 3, name: str = "meshrl",
                 log_dir: pathlib.Path | None = None, authorization: dict | None = None,
                 config_dir: pathlib.Path | None = None, route_auth: tuple[str, str] | None = None,
                 connect_options: dict | None = None) -> None:
        ports = list(ports) if ports else [free_port() for _ in range(size)]
        cluster_ports = list(cluster_ports) if cluster_ports else [free_port() for _ in range(size)]
        if len(ports) != size:
            raise FieldError("ports", f"need {size}, got {len(ports)}")
        if len(cluster_ports) != size:
            raise FieldError("cluster_ports", f"need {size}, got {len(cluster_ports)}")
        if len(set(ports) | set(cluster_ports)) != 2 * size:
            raise ValueError(f"ports, cluster_ports: must be {2 * size} distinct ports, got {ports} and {cluster_ports}")
        self.store = store
        self.name = name
        self.connect_options = dict(connect_options or {})
        routes = [f"nats://127.0.0.1:{p}" for p in cluster_ports]
        self.nodes = [
            NatsServer(store / f"n{i}", ports[i], server_name=f"n{i}", cluster_name=name, cluster_port=cluster_ports[i],
                       routes=[r for j, r in enumerate(routes) if j != i],
                       log_path=log_dir / f"nats-n{i}.log" if log_dir is not None else None,
                       authorization=authorization, route_auth=route_auth,
                       config_path=config_dir / f"nats-n{i}.conf" if config_dir is not None else None)
            for i in range(size)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @property
    def detach(self) -> bool:
        return self.nodes[0].detach

    @detach.setter
    def detach(self, value: bool) -> None:
        for node in self.nodes:
            node.detach = value

    def start(self, timeout: float = 30.0) -> None:
        """Start every node, then wait until every node is a placeable JetStream peer."""
        for node in self.nodes:
            node.spawn()
        for node in self.nodes:
            node.wait_listening(timeout)
        self.wait_jetstream(timeout)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        self.nodes[i].kill(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT) and self.nodes[i].proc is not None:
            try:
                self.nodes[i].proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def start_node(self, i: int, *, timeout: float = 30.0) -> None:
        """Start node `i` again (same ports and store) and wait until it is a placeable peer, asking through it."""
        self.nodes[i].start(timeout)
        self.wait_jetstream(timeout, urls=[self.nodes[i].url])

    def wait_jetstream(self, timeout: float = 30.0, *, urls: Sequence[str] | None = None) -> None:
        run_sync(jetstream_ready(list(urls or self.urls), timeout, replicas=len(self.nodes), **self.connect_options))

    def stop(self, timeout: float = 10.0) -> None:
        for node in self.nodes:
            if node.alive:
                node.proc.terminate()
        for node in self.nodes:
            node.stop(timeout)


READY_PROBE = "MESHRL_READY"  # a memory stream created and deleted again by jetstream_ready(replicas > 1)


async def jetstream_ready(urls: Sequence[str], timeout: float, *, replicas: int = 1, **connect_options) -> None:
    """Until JetStream answers through one of `urls`, or TimeoutError.

    Answering is `account_info()` succeeding (a meta leader exists). With `replicas` > 1 it is also placing a
    stream of that many replicas: a meta leader counts a node that has just joined or come back as an offline
    peer for a moment, and refuses such a stream ("no suitable peers for placement"). `connect_options`:
    credentials for `nats.connect` (a user that may create and delete the probe stream).
    """
    import nats
    from nats.js.api import StorageType

    async def quiet(*_args) -> None:
        return None

    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for url in urls:
            try:
                nc = await nats.connect(servers=[url], connect_timeout=1, allow_reconnect=False,
                                        max_reconnect_attempts=0, error_cb=quiet, **connect_options)
            except Exception as exc:  # not listening yet
                last = exc
                continue
            try:
                js = nc.jetstream(timeout=2.0)
                await js.account_info()
                if replicas > 1:
                    await js.add_stream(name=READY_PROBE, subjects=[f"_meshrl.{READY_PROBE}"],
                                        num_replicas=replicas, storage=StorageType.MEMORY)
                    await js.delete_stream(READY_PROBE)
                return
            except Exception as exc:  # no meta leader yet ("JetStream system temporarily unavailable"), a peer
                # still offline, or a timeout
                last = exc
            finally:
                await nc.close()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"JetStream not ready on {','.join(urls)} within {timeout}s: {last!r}")


def run_sync(coro) -> None:
    """Run a coroutine to completion from sync code, also when the caller is inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
        return
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name="nats-wait")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


class TrainerRanks:
    """A trainer of `ranks` processes started together (torchrun-style environment, a fresh MASTER_PORT each
    time): `spawn` stops what is left of the previous group, starts ranks 1.. and returns rank 0, the process the
    supervisor watches. A rank that dies fails rank 0 (its next collective or heartbeat), which the supervisor
    restarts, and with it the whole group."""

    def __init__(self, command: list[str], ranks: int, log_dir: pathlib.Path, *, cwd: pathlib.Path,
                 env: dict[str, str], detach: bool = False) -> None:
        self.command, self.ranks, self.log_dir, self.cwd, self.env, self.detach = command, ranks, log_dir, cwd, env, detach
        self.followers: list[subprocess.Popen] = []

    def spawn(self) -> subprocess.Popen:
        self.stop(grace=5.0)
        group = {"WORLD_SIZE": str(self.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        self.followers = [self._start(rank, group) for rank in range(1, self.ranks)]
        return self._start(0, group)

    def _start(self, rank: int, group: dict[str, str]) -> subprocess.Popen:
        name = "trainer.log" if rank == 0 else f"trainer-rank{rank}.log"
        env = {**self.env, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(self.log_dir / name, "ab") as log:
            return popen(self.command, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, detach=self.detach)

    def stop(self, grace: float = 30.0) -> None:
        """Ranks 1.. (rank 0 is the supervisor's): they exit on rank 0's stop command, else are terminated."""
        deadline = time.monotonic() + grace
        for proc in self.followers:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.followers = []
