"""Framing on the sender's control connection, and byte views of tensors. Blocking sockets (run in threads)."""

from __future__ import annotations

import socket
import struct
import time
import zlib
from typing import Any

import msgpack
import torch

from services.common.errors import FieldError
from services.weight_exchange.client.regions import Region

_LEN = struct.Struct("!I")
MAX_FRAME = 256 << 20
# The first frame of a pull (the header: receiver, version, ticket) comes before any credential is checked, so it is
# kept small: a peer without a ticket can make the sender hold a few KiB, not MAX_FRAME (the items come after).
MAX_HEADER = 4 << 10


class TransportError(RuntimeError):
    """A transfer failed; the message names the ranks and the tensor."""


class TransferTimeout(TransportError):
    """A transfer ran past its deadline."""


def send_frame(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> Any:
    """The next frame; TransportError, before allocating anything, when it announces more than `limit` bytes."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > limit:
        raise TransportError(f"frame of {n} bytes exceeds {limit}")
    return msgpack.unpackb(recv_exact(sock, n), raw=False)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError("connection closed by the peer")
        got += k


def set_deadline(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("deadline passed")
    sock.settimeout(left)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (writable), any dtype (bf16 included: the bytes are
    taken as uint8). A device (GPU / NPU) tensor has no host bytes: move it through `host()` or a CPU staging
    tensor and `copy_`, never `.numpy()`."""
    if t.device.type != "cpu":
        raise TypeError(f"byte_view: a {t.device.type} tensor has no host bytes; copy it through a CPU staging tensor")
    assert t.is_contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of `t`'s values: `t` itself when it is one, else a copy (a GPU / NPU parameter)."""
    if t.device.type == "cpu":
        return t if t.is_contiguous() else t.contiguous()
    return t.detach().contiguous().cpu()


def region_view(t: torch.Tensor, region: Region) -> torch.Tensor:
    return t[region.slices()] if region.ndim else t


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(byte_view(host(t)))


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FieldError("dtype", f"unknown {name!r}")
    return dtype
