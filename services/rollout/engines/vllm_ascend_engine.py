"""The vLLM engine on Ascend NPUs (`engine.kind: vllm_ascend`): the vLLM engine, with vLLM-Ascend in the server's
venv (`engine.vllm.python`; the plugin registers itself with vLLM) and `engine.device: npu | npu:N`.

What differs from `vllm`:
- the device: torch_npu is imported (only here, when the engine starts) to check the NPU is there; a missing
  library or device is a RuntimeError naming `engine.device`. `npu:N` pins the started server to that NPU
  (ASCEND_RT_VISIBLE_DEVICES).
- collectives: HCCL wherever the NCCL would be named (`collective_backend`).
- the weight layout: vLLM-Ascend keeps the fused MoE experts transposed after loading (`w13_weight`
  [E, H, 2I], `w2_weight` [E, I, H]). The stage that `named_parameters()` returns holds checkpoint tensors under
  their Hugging Face names, which the server's reload lays out itself, so it is registered as for `vllm`. A
  receiver living next to the live parameters (inside a worker) registers `receiver_layout(...)`: the
  `vllm_ascend` formula layout and transposed views of the same storage, so each byte lands in place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any
from unittest import mock  # patch.dict: set and restore environment variables around the launch

from services.common.device import check_device, resolve_device
from services.common.errors import FieldError
from services.common.logging import get_logger
from services.rollout.engines.vllm_engine import VLLMConfig, VLLMEngine

LAYOUT_ENGINE = "vllm_ascend"   # services.weight_exchange.client.layouts: the transposed-experts layout


def check_ascend_device(device: str) -> None:
    """ValueError naming engine.device unless it is npu or npu:N (nothing imported)."""
    check_device(device, "engine.device")
    if device.partition(":")[0] != "npu":
        raise FieldError("engine.device", f"engine.kind vllm_ascend runs on Ascend NPUs: set npu or npu:N, got {device!r}")


def build_vllm_ascend(config: VLLMConfig, *, device: str, **engine_args) -> VLLMAscendEngine:
    check_ascend_device(device)
    plain = config.build(**engine_args)  # the vLLM engine's checks (model, dtype, sizes); starts nothing
    return VLLMAscendEngine(config, device=device, model_path=plain.model_path, max_batch=plain.max_batch,
                            max_context=plain.max_context, dtype=plain.dtype, seed=plain.seed, version=plain.version,
                            vocab_size=plain.vocab_size, eos_token_ids=plain.eos_token_ids, run_dir=plain.run_dir)


class VLLMAscendEngine(VLLMEngine):
    kind = "vllm_ascend"
    collective_backend = "hccl"
    layout_engine = LAYOUT_ENGINE

    def __init__(self, config: VLLMConfig, *, device: str, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.device = device
        self.log = get_logger().bind(engine="vllm_ascend")

    def start(self) -> None:
        resolve_device(self.device, "engine.device")  # imports torch_npu: RuntimeError naming the field if missing
        super().start()

    def _launch(self) -> None:
        _, _, index = self.device.partition(":")
        with mock.patch.dict(os.environ, {"ASCEND_RT_VISIBLE_DEVICES": index}) if index else contextlib.nullcontext():
            super()._launch()


def receiver_layout(rank_id: str, params: Mapping[str, Any], spec, **parallel) -> tuple[Any, dict[str, Any]]:
    """(layout, tensors) for a weight-exchange receiver over the live parameters of one vLLM-Ascend rank: the
    `vllm_ascend` layout checked against what it holds (LayoutMismatch names each difference) and the tensors to
    write through (transposed experts as views in the layout's shapes). `parallel`: tp, tp_rank, ep, ... as
    `live_layout` takes them."""
    from services.weight_exchange.client.layouts.live import live_layout, receiver_views

    return live_layout(rank_id, params, spec, LAYOUT_ENGINE, **parallel), receiver_views(LAYOUT_ENGINE, params)
