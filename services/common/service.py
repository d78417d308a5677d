"""Process entry point shared by every service: config, logging, signals, metrics."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.common.config import ConfigError, ServiceConfig, load_config
from services.common.errors import FieldError
from services.common.logging import configure_logging, get_logger
from services.common.metrics import start_metrics_server

C = TypeVar("C", bound=ServiceConfig)
EXIT_CODE = 0


def main(service: str, config_cls: type[C], serve: Callable[[C, asyncio.Event], Awaitable[None]],
         argv: list[str] | None = None) -> None:
    """`python -m services.<service> [--config file.yaml]`: run until SIGTERM / SIGINT, then shut down cleanly."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}")
    parser.add_argument("--config", help="YAML config file (env MESHRL_<SERVICE>__<KEY> overrides it)")
    args = parser.parse_args(argv)
    try:
        config = load_config(config_cls, service, path=args.config)
    except (ConfigError, OSError) as exc:
        print(f"meshrl {service}: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    configure_logging(service, config.log_level)
    pin_cpus(service)
    asyncio.run(_run(service, config, serve))
    raise SystemExit(EXIT_CODE)


def pin_cpus(service: str) -> None:
    """MESHRL_CPUS_<SERVICE> (e.g. "1" or "0,1"): run this process, and the processes it starts, on those CPUs only
    (benchmarks give rollout and trainer a core each)."""
    name = f"MESHRL_CPUS_{service.upper()}"
    text = os.environ.get(name, "").strip()
    if not text or not hasattr(os, "sched_setaffinity"):
        return
    try:
        cpus = {int(c) for c in text.split(",")}
    except ValueError:
        raise FieldError(name, f"comma-separated CPU numbers, got {text!r}") from None
    os.sched_setaffinity(0, cpus)


async def _run(service: str, config: C, serve: Callable[[C, asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics_port = start_metrics_server(config.metrics_port, config.metrics_address)
    get_logger().info("starting", metrics_port=metrics_port)
    await serve(config, stop)
    get_logger().info("stopped")


def supervise(tasks: list[asyncio.Task], stop: asyncio.Event) -> None:
    """A background task that dies takes the service down (so its supervisor restarts it), loudly."""

    def on_done(task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        assert exc is not None
        get_logger().error("task_crashed", task=task.get_name(), error=repr(exc),
                           exc_info=(type(exc), exc, exc.__traceback__))
        global EXIT_CODE
        EXIT_CODE = 1
        stop.set()

    for task in tasks:
        task.add_done_callback(on_done)
