"""Trainer backends behind one interface (``base.TrainerBackend``), chosen by ``TrainerConfig.backend``:
``torch`` (one process, one full copy of the model), ``fsdp2`` (``fully_shard`` over data-parallel ranks) and
``megatron`` (megatron-core GPTModel ranks, tensor x data parallel; its pieces in ``services/trainer/megatron``).
Imported lazily: a backend's libraries load only when it is used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.common.errors import FieldError

if TYPE_CHECKING:
    from services.trainer.backends.base import TrainerBackend
    from services.trainer.config import TrainerConfig

REGISTRY = {
    "torch": "services.trainer.backends.torch_backend:TorchBackend",
    "fsdp2": "services.trainer.backends.fsdp2:FSDP2Backend",
    "megatron": "services.trainer.backends.megatron_backend:MegatronBackend",
}
BACKENDS = tuple(REGISTRY)


def backend_class(name: str) -> type[TrainerBackend]:
    if name not in REGISTRY:
        raise FieldError("backend", f"unknown {name!r}; one of {', '.join(BACKENDS)}")
    module, _, cls = REGISTRY[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise FieldError("backend", f"{name} is not available here ({exc})") from exc


def build(config: TrainerConfig) -> TrainerBackend:
    """This process's rank of the configured backend (a process group is joined when the backend has ranks)."""
    return backend_class(config.backend)(config)
