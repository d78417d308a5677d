"""What this CPU runs natively, asked once per process: the engine and the trainer choose their bf16 paths from it.

Native bf16 (oneDNN's bf16 matmuls) needs AVX512-BF16 / AVX512BW+VL+DQ or AVX-NE-CONVERT; many CPUs in service
(AMD EPYC before Zen 4, most laptops) have AVX2 only. There, torch refuses oneDNN's prepacked bf16 linears
("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq") and emulates plain bf16
matmuls, 4-18x slower than float32 (measured on an AVX-512 EPYC forced down to AVX2: a 576x2304 linear at 256
rows 35.5 ms in bf16 against 6.9 ms in float32; an MLP's training step 496 ms under bf16 autocast against 28 ms).

The answer comes from running the kernel, not from reading CPU flags, so it holds whatever limits the process
runs under. `ONEDNN_MAX_CPU_ISA=AVX2` (read by oneDNN at its first use, so set it before the process starts) makes
an AVX-512 machine answer as an AVX2-only one: the tests use it to run both paths on any machine.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16() -> bool:
    """True when oneDNN runs bf16 matmuls natively on this CPU (a tiny prepacked bf16 linear runs)."""
    if not onednn_linear():
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=torch.bfloat16), weight, None, "none", [], "")
    except RuntimeError:  # the kernel's own refusal: this CPU (or the ISA the process is held to) lacks it
        return False
    return bool(out.float().eq(8.0).all())


@functools.cache
def onednn_linear() -> bool:
    """True when torch has oneDNN's prepacked linear (every x86-64 build has; float32 runs on any x86-64 CPU)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def describe() -> dict[str, object]:
    """For start-up logs and benchmark lines."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16()}
