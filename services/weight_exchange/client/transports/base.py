"""The transport interface and what both sides of one link share."""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, Protocol

import torch

from services.weight_exchange.client.wire import torch_dtype


@dataclasses.dataclass
class Item:
    """One region on one link: where it is read on the sender and written on the receiver."""

    canonical_name: str
    bucket: int
    num_bytes: int
    dtype: str                      # wire dtype
    dst: torch.Tensor | None = None  # receiver: view of the live tensor


@dataclasses.dataclass
class Link:
    """The receiver's view of one pull: its items in plan order and the deadline."""

    src: str
    dst: str
    items: list[Item]
    deadline: float                 # time.monotonic()
    verify: bool = False
    current: int = -1               # index of the item in flight (for error messages)
    received: int = -1              # payload bytes, when they differ from the items' (a delta); -1: the items'

    def staging(self) -> torch.Tensor:
        size = max((it.num_bytes for it in self.items), default=0)
        return torch.empty(size, dtype=torch.uint8)

    def describe(self) -> str:
        if 0 <= self.current < len(self.items):
            it = self.items[self.current]
            return f"tensor {it.canonical_name} (bucket {it.bucket})"
        return "the link"


def staged(staging: torch.Tensor, item: Item) -> torch.Tensor:
    """A wire-dtype tensor of the item's shape over the first bytes of the staging buffer."""
    assert item.dst is not None
    return staging[:item.num_bytes].view(torch_dtype(item.dtype)).view(item.dst.shape)


def direct(item: Item) -> bool:
    """Bytes can land straight in the live tensor (contiguous view, same dtype)."""
    assert item.dst is not None
    return item.dst.is_contiguous() and str(item.dst.dtype).removeprefix("torch.") == item.dtype


class Transport(Protocol):
    name: str

    def serve(self, conn: socket.socket, request: dict[str, Any], views: list[torch.Tensor], server: Any) -> None:
        """Sender side: reply `{"ok": True, ...}` on `conn`, then move `views` (in order) to the receiver."""

    def pull(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
        """Receiver side: after the ok reply, write every item of `link` into its `dst` view."""
