"""torch.distributed point-to-point: a two-rank process group per pull (sender rank 0, receiver rank 1).

The group is built from a TCPStore the sender hosts, not from the default group, so it works beside a
trainer's own torch.distributed world. gloo runs here (CPU); NCCL (CUDA tensors) and HCCL (Ascend, through
torch_npu) use the same code with their process-group classes, imported lazily: written against the
documented constructors, not run on this machine.
"""

from __future__ import annotations

import datetime
import socket
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from services.weight_exchange.client.transports.base import Link, direct, staged
from services.weight_exchange.client.wire import TransferTimeout, send_frame


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _TorchDist:
    name = "gloo"

    def make_group(self, store: dist.Store, rank: int, host: str, timeout: float) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    def device(self) -> torch.device:
        return torch.device("cpu")

    def setup_sender(self, server: Any, endpoint: str) -> str:
        key = f"{self.name}_store"
        if key not in server.extras:
            server.extras[key] = dist.TCPStore(server.host, 0, is_master=True, wait_for_workers=False,
                                               timeout=datetime.timedelta(seconds=60))
        return endpoint

    def close_sender(self, server: Any) -> None:
        server.extras.pop(f"{self.name}_store", None)

    def serve(self, conn: socket.socket, request: dict[str, Any], views: list[torch.Tensor], server: Any) -> None:
        store = server.extras[f"{self.name}_store"]
        prefix = f"wx/{request.get('receiver', '?')}/{uuid.uuid4().hex}"
        timeout = float(request.get("timeout", 60.0))
        deadline = time.monotonic() + timeout   # the receiver's deadline for the whole pull, not per tensor
        send_frame(conn, {"ok": True, "store": f"{server.host}:{store.port}", "prefix": prefix})
        group = self.make_group(dist.PrefixStore(prefix, store), 0, conn.getsockname()[0], timeout)
        for tag, v in enumerate(views):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"{self.name}: the receiver's {timeout:g}s passed after {tag} of {len(views)} "
                                      "tensors")
            if v.device.type != self.device().type:   # e.g. a GPU parameter over gloo: through a host copy
                v = v.to(self.device())
            _wait(group.send([_bytes(v if v.is_contiguous() else v.contiguous())], 1, tag), left)

    def pull(self, conn: socket.socket, reply: dict[str, Any], link: Link) -> None:
        host, port = reply["store"].rsplit(":", 1)
        left = link.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("deadline passed before the process group was built")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=left))
        group = self.make_group(dist.PrefixStore(reply["prefix"], store), 1, conn.getsockname()[0], left)
        staging = None
        for tag, item in enumerate(link.items):
            link.current = tag
            assert item.dst is not None
            left = link.deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout("deadline passed")
            if direct(item) and item.dst.device.type == self.device().type:   # else via staging on the device
                _wait(group.recv([_bytes(item.dst)], 0, tag), left)
                continue
            if staging is None:
                staging = link.staging().to(self.device())
            _wait(group.recv([staging[:item.num_bytes]], 0, tag), left)
            item.dst.copy_(staged(staging, item))


def _wait(work: Any, timeout: float) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            raise TransferTimeout(str(exc)) from exc
        raise


class GlooTransport(_TorchDist):
    name = "gloo"


class NcclTransport(_TorchDist):
    """NCCL between GPUs: parameter tensors on CUDA on both sides (not runnable on a CPU-only host)."""

    name = "nccl"

    def make_group(self, store: dist.Store, rank: int, host: str, timeout: float) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())


class HcclTransport(_TorchDist):
    """HCCL between Ascend NPUs through torch_npu (not runnable here)."""

    name = "hccl"

    def make_group(self, store: dist.Store, rank: int, host: str, timeout: float) -> Any:
        import torch_npu  # noqa: F401  (registers the NPU device)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        opts = ProcessGroupHCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        return ProcessGroupHCCL(store, rank, 2, opts)

    def device(self) -> torch.device:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
