"""The trainer's engine: the configured backend (``services/trainer/backends``). ``TrainerEngine`` is the
single-process ``torch`` backend, which tests and tools build directly."""

from __future__ import annotations

from services.trainer.backends import build as build_engine
from services.trainer.backends.base import TrainerBackend
from services.trainer.backends.torch_backend import TorchBackend as TrainerEngine

__all__ = ["TrainerBackend", "TrainerEngine", "build_engine"]
