"""Transports behind one interface: the sender serves a pull request on its control connection, the receiver
pulls into views of its live tensors. Implementations are imported lazily (ucx, nccl, hccl need extra packages).
"""

from __future__ import annotations

import importlib

from services.common.errors import FieldError
from services.weight_exchange.client.transports.base import Link, Transport

KNOWN = {
    "tcp": "services.weight_exchange.client.transports.tcp:TcpTransport",
    "shm": "services.weight_exchange.client.transports.shm:ShmTransport",
    "shm-ring": "services.weight_exchange.client.transports.shm:ShmRingTransport",
    "gloo": "services.weight_exchange.client.transports.torchdist:GlooTransport",
    "nccl": "services.weight_exchange.client.transports.torchdist:NcclTransport",
    "hccl": "services.weight_exchange.client.transports.torchdist:HcclTransport",
    "ucx": "services.weight_exchange.client.transports.ucx:UcxTransport",
}
_cache: dict[str, Transport] = {}


def get(name: str) -> Transport:
    """The transport called `name`; ValueError naming the field when unknown."""
    if name not in KNOWN:
        raise FieldError("transport", f"unknown {name!r} (known: {', '.join(KNOWN)})")
    if name not in _cache:
        module, cls = KNOWN[name].split(":")
        _cache[name] = getattr(importlib.import_module(module), cls)()
    return _cache[name]


__all__ = ["KNOWN", "Link", "Transport", "get"]
