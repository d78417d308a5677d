"""`device: cpu | cuda | npu`, optionally with an index (`cuda:1`): checked when a config is built, resolved when
the service starts. torch_npu is imported only for npu (it registers the device with torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.common.errors import FieldError

if TYPE_CHECKING:
    import torch

KINDS = ("cpu", "cuda", "npu")


def check_device(name: str, field: str = "device") -> str:
    """ValueError naming `field` unless `name` is cpu, cuda, npu, cuda:N or npu:N."""
    kind, colon, index = str(name).partition(":")
    if kind not in KINDS or (colon and (kind == "cpu" or not index.isdigit())):
        raise FieldError(field, f"expected cpu, cuda, npu, cuda:N or npu:N, got {name!r}")
    return name


def resolve_device(name: str, field: str = "device") -> torch.device:
    """The torch device; RuntimeError naming `field` when this machine lacks it or its library."""
    import torch

    kind, _, index = check_device(name, field).partition(":")
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"{field}: {name} needs torch_npu (the Ascend plugin), which is not installed") from exc
    backend = getattr(torch, kind)
    if not backend.is_available():
        raise RuntimeError(f"{field}: {name} is not available on this machine (torch {torch.__version__})")
    count = backend.device_count()
    if index and int(index) >= count:
        raise RuntimeError(f"{field}: {name} does not exist; this machine has {count} {kind} device(s)")
    return torch.device(name)


def host_copy(obj: Any) -> Any:
    """`obj` (tensors in dicts, lists, tuples) with every tensor on the CPU: what checkpoints are written from.
    CPU tensors are kept as they are; tensors that share storage share it in the copy too (tied weights)."""
    import torch

    memo: dict[tuple, torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu":
                return x
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()), x.dtype)
            if key not in memo:
                memo[key] = x.detach().cpu()
            return memo[key]
        if isinstance(x, dict):
            return type(x)((k, copy(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    return copy(obj)
