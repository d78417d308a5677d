"""The rollout service's configuration."""

from __future__ import annotations

import dataclasses
import os

from services.common.config import ServiceConfig
from services.common.errors import FieldError
from services.rollout.engines.sglang_engine import SGLangConfig
from services.rollout.engines.torch_engine import EngineConfig
from services.rollout.engines.vllm_ascend_engine import build_vllm_ascend, check_ascend_device
from services.rollout.engines.vllm_engine import VLLMConfig
from services.rollout.gateway.config import GatewayConfig


def default_rank_id() -> str:
    """Unique per replica in a container (Compose and Kubernetes set HOSTNAME to the container or pod name)."""
    host = os.environ.get("HOSTNAME", "")
    return f"rollout-{host}" if host else "rollout-0"


ENGINE_KINDS = ("embedded", "vllm", "vllm_ascend", "sglang")


@dataclasses.dataclass(kw_only=True)
class RolloutEngineConfig(EngineConfig):
    """The engine section: `kind` picks the engine; model_path, max_batch, max_context, dtype, seed and
    initial_version apply to all (vLLM: --max-num-seqs, --max-model-len; SGLang: --max-running-requests,
    --context-length), device to the embedded engine and vllm_ascend (npu or npu:N), torch_threads to the embedded
    engine only."""

    kind: str = "embedded"  # embedded (torch, in this process) | vllm | vllm_ascend (section vllm) | sglang (section sglang)
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind not in ENGINE_KINDS:
            raise FieldError("engine.kind", f"must be one of {', '.join(ENGINE_KINDS)}, got {self.kind!r}")
        if self.kind == "vllm_ascend":
            check_ascend_device(self.device)
        if self.lora.enabled and not self._merges_adapters():
            raise FieldError("engine.lora", f"LoRA adapters are merged by the embedded engine or inside the engine's "
                                            f"workers (vllm.weight_path worker, sglang.weight_sync worker); this "
                                            f"{self.kind} engine takes merged weights (trainer lora.sync: merged)")
        if self.record_routes and self.kind not in ("embedded", "vllm"):
            raise FieldError("engine.record_routes", f"routed experts are recorded by the embedded and vllm engines; "
                                                     f"the {self.kind} engine here does not return them")

    def _merges_adapters(self) -> bool:
        if self.kind in ("vllm", "vllm_ascend"):
            return self.vllm.weight_updates and self.vllm.weight_path == "worker"
        return self.kind == "embedded" or (self.kind == "sglang" and self.sglang.weight_sync == "worker")

    def build(self, run_dir: str = ""):
        engine = self._build(run_dir)
        if self.kind != "embedded" and self.lora.enabled:
            engine.take_adapters(self.lora)
        return engine

    def _build(self, run_dir: str):
        common = dict(model_path=self.model_path, max_batch=self.max_batch, max_context=self.max_context,
                      dtype=self.dtype, seed=self.seed, version=self.initial_version, run_dir=run_dir)
        if self.kind == "vllm":
            vllm = dataclasses.replace(self.vllm, return_routed_experts=True) if self.record_routes else self.vllm
            return vllm.build(**common)
        if self.kind == "vllm_ascend":
            return build_vllm_ascend(self.vllm, device=self.device, **common)
        if self.kind == "sglang":
            return self.sglang.build(**common)
        return super().build()


@dataclasses.dataclass(kw_only=True)
class RolloutConfig(ServiceConfig):
    grpc_address: str = "127.0.0.1:50051"
    rank_id: str = dataclasses.field(default_factory=default_rank_id)  # the weight exchange's name for this rank
    engine: RolloutEngineConfig = dataclasses.field(default_factory=RolloutEngineConfig)
    concurrency: int = 64  # prompt-work messages generated at once
    wx_address: str = "127.0.0.1:50055"  # weight_exchange; empty: no weight updates
    reward_address: str = "127.0.0.1:50052"  # the gateway's /rl/run_code and graded sessions; empty: neither
    catch_up_timeout: float = 120.0  # at start, wait this long for the trainer's weights before generating anyway
    gateway_enabled: bool = False  # serve the OpenAI / Anthropic agent gateway (make up turns it on)
    gateway: GatewayConfig = dataclasses.field(default_factory=GatewayConfig)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise FieldError("concurrency", f"must be >= 1, got {self.concurrency}")
        if self.catch_up_timeout <= 0:
            raise FieldError("catch_up_timeout", f"must be positive, got {self.catch_up_timeout}")
