"""MoE routing replay (R3) for Hugging Face models: the rollout engine records the experts each router chose for
every token it fed through the model, and the trainer's forward uses those choices instead of routing again.

Why: the trainer's forward computes the router's scores in another kernel, batch shape and often dtype than the
engine's, and a near-tie between two experts flips. The token's hidden state then goes through other experts, and
the log-prob the trainer computes is not the one the token was sampled with; replay removes that source of
train/infer mismatch (the gradients still flow through the replayed experts' router probabilities).

How: a router of a Hugging Face MoE (Qwen2/3-MoE, Mixtral, OLMoE, ... `<Model>TopKRouter`) takes the flattened
hidden states [N, hidden] and calls `torch.topk(probs [N, num_experts], top_k)` once over its experts. The
modeling module's `torch` is swapped for a proxy whose `topk`, inside a router's forward (its pre-hook names the
layer) and on a [N, num_experts] input with k == top_k, records the indices or returns the replayed ones with
their probabilities gathered, so each model's own normalisation and casts run unchanged. Every other call passes
through. State is per thread: the engine's thread records while the trainer's thread replays.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
import weakref
from collections.abc import Iterator

import torch

from services.common.contracts import data_pb2
from services.common.routed_experts import encode

_state = threading.local()  # .layer: the router whose forward runs; .recording: list per layer; .targets
_sets: weakref.WeakKeyDictionary[torch.nn.Module, RouterSet] = weakref.WeakKeyDictionary()


def is_router(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("Router") and isinstance(getattr(module, "top_k", None), int)
            and isinstance(getattr(module, "num_experts", None), int))


class ReplayCounts:
    """What every router replay (RouterSet here, megatron/routing.py's MegatronRoutes) shares: the check of the
    targets it is given and the counts `replayed_indices` keeps."""

    layers: int
    top_k: int
    replayed = 0   # token x layer choices replayed since the last take_stats()
    differed = 0   # ... where the model's own top-k set was another one

    def check_targets(self, targets: torch.Tensor) -> None:
        if targets.dim() != 3 or tuple(targets.shape[1:]) != (self.layers, self.top_k):
            raise ValueError(f"routed_experts: recorded for {tuple(targets.shape[1:])} (layers, top_k), the model "
                             f"routes {self.layers} layers x top-{self.top_k}")

    def take_stats(self) -> dict[str, float]:
        """Replay counters since the last call: routing_replayed (token x layer choices) and routing_differed
        (the fraction of those where the trainer's own routing chose another set of experts)."""
        out = {"routing_replayed": float(self.replayed),
               "routing_differed": self.differed / self.replayed if self.replayed else 0.0}
        self.replayed = self.differed = 0
        return out


class RouterSet(ReplayCounts):
    """The routers of one model, in layer order, hooked for recording and replay."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if is_router(m)]
        if not self.routers:
            raise ValueError(f"routing_replay: {type(model).__name__} has no MoE router this replay knows (a module "
                             f"named *Router with top_k and num_experts: Qwen2/3-MoE, Mixtral, OLMoE, ...)")
        tops: set[int] = {getattr(m, "top_k") for m in self.routers}  # noqa: B009 - an int (is_router checked)
        assert len(tops) == 1, f"routers with different top_k {tops}"
        self.top_k = tops.pop()
        self.layers = len(self.routers)
        self.num_experts = self.routers[0].num_experts
        for layer, router in enumerate(self.routers):
            _proxy_torch(sys.modules[type(router).__module__])
            router.register_forward_pre_hook(lambda _m, _a, layer=layer: setattr(_state, "layer", layer))
            router.register_forward_hook(lambda *_: setattr(_state, "layer", None))

    @contextlib.contextmanager
    def record(self) -> Iterator[list[list[torch.Tensor]]]:
        """Within: every router forward appends its indices [N, top_k] to the yielded list of its layer."""
        recording: list[list[torch.Tensor]] = [[] for _ in self.routers]
        _state.recording, _state.targets = recording, None
        try:
            yield recording
        finally:
            _state.recording = None

    @contextlib.contextmanager
    def replay(self, targets: torch.Tensor) -> Iterator[None]:
        """Within: each router forward of N tokens takes `targets` [N, layers, top_k] (int, -1: the model's own
        choice for that token) as its chosen experts. N is the flattened batch (rows x positions)."""
        self.check_targets(targets)
        _state.recording, _state.targets, _state.owner = None, targets, self
        try:
            yield
        finally:
            _state.targets = None


def routers_of(model: torch.nn.Module) -> RouterSet:
    """The model's RouterSet (built, and its modules hooked, on first use); ValueError for a model without one."""
    found = _sets.get(model)
    if found is None:
        found = _sets[model] = RouterSet(model)
    return found


def register(model: torch.nn.Module, routes) -> None:
    """Another framework's routers (megatron/routing.py's MegatronRoutes: `replay(targets)`, `take_stats()`) as
    the replay of `model`'s forwards."""
    _sets[model] = routes


def replaying(model: torch.nn.Module) -> RouterSet | None:
    """The model's RouterSet if replay was turned on for it (`routers_of`), else None."""
    return _sets.get(model)


def _replay_topk(probs: torch.Tensor, k: int, layer: int) -> torch.return_types.topk:
    targets = _state.targets
    own = _TORCH.topk(probs, k, dim=-1)
    indices = replayed_indices(own.indices, targets[:, layer], _state.owner)
    return torch.return_types.topk((probs.gather(-1, indices), indices))


def replayed_indices(own: torch.Tensor, recorded: torch.Tensor, counts) -> torch.Tensor:
    """The experts [N, top_k] a router forward routes by: `recorded` (int, -1: none) where a token has a record,
    the router's `own` choice elsewhere. `counts.replayed` / `counts.differed` (RouterSet, MegatronRoutes) grow by
    the tokens replayed and those of them whose own choice was another set of experts."""
    if recorded.shape[0] != own.shape[0]:
        raise RuntimeError(f"routing replay: {recorded.shape[0]} routed tokens for a router forward of "
                           f"{own.shape[0]}")
    chosen = recorded.to(device=own.device, dtype=torch.long)
    given = (chosen >= 0).all(-1, keepdim=True)
    indices = torch.where(given, chosen, own)
    with torch.no_grad():
        n = int(given.sum())
        if n:
            same = (own.sort(-1).values == indices.sort(-1).values).all(-1, keepdim=True)
            counts.replayed += n
            counts.differed += int((given & ~same).sum())
    return indices


class _TorchProxy(types.ModuleType):
    """`torch` for a modeling module: `topk` is intercepted inside a router's forward, the rest passes through."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(_TORCH, name)

    @staticmethod
    def topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):  # noqa: A002 - torch.topk's own names
        layer = getattr(_state, "layer", None)
        if layer is None or out is not None or not largest or dim not in (-1, input.dim() - 1) or input.dim() != 2:
            return _TORCH.topk(input, k, dim=dim, largest=largest, sorted=sorted, out=out)
        if getattr(_state, "targets", None) is not None and input.shape[-1] == _state.owner.num_experts \
                and k == _state.owner.top_k:
            return _replay_topk(input, k, layer)
        found = _TORCH.topk(input, k, dim=dim, largest=largest, sorted=sorted)
        recording = getattr(_state, "recording", None)
        if recording is not None:
            recording[layer].append(found.indices.detach())
        return found


_TORCH = torch
_PROXY = _TorchProxy()


def _proxy_torch(module: types.ModuleType) -> None:
    if module.__dict__.get("torch") is _TORCH:
        module.__dict__["torch"] = _PROXY  # that module's `torch.` calls go through the proxy


def to_proto(chunks: list | None, positions: int) -> data_pb2.RoutedExperts | None:
    """A sequence's recorded routes (`Sequence.routes`: tensors or arrays [n, layers, top_k]) as the contract's
    message, cut to at most `positions` (prompt + completion); None when nothing was recorded."""
    if not chunks:
        return None
    return encode(torch.cat([torch.as_tensor(c) for c in chunks])[:positions].numpy())
