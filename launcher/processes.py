"""Local processes: a real nats-server with JetStream, free ports."""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    return str(pathlib.Path(sys.executable).parent / "nats-server")


class NatsServer:
    """A real nats-server with JetStream on a free loopback port."""

    def __init__(self, store: pathlib.Path, port: int | None = None) -> None:
        self.store = store
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.detach = False  # survive the parent (make up)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port),
                                      "-sd", str(self.store)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=self.detach)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=10)
