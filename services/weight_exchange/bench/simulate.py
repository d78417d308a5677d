"""Paper-scale plans from shapes only (no tensors): plan statistics and modeled seconds beside the naive plan.

Model: every rank has one link of `link_gbps` GB/s (full duplex, full bisection, no latency). The planned
update takes `max bytes through one rank / link`. Naive: gather the full model onto trainer rank 0, then
send it whole to every inference rank from that rank (`naive_seconds`); `naive_bcast_seconds` gives the
naive plan a perfectly pipelined broadcast instead (model bytes once through rank 0's link).
"""

from __future__ import annotations

import time
from typing import Any

from services.weight_exchange.client.layout import RECEIVER, SENDER
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import parse_side, side_layouts
from services.weight_exchange.planner import bytes_min, plan

SCENARIOS = [
    # 4 nodes x 16 accelerators for training, as many for inference
    ("qwen3-30b-a3b", "megatron:tp=4,pp=2,ep=8,dp=8", "vllm:tp=4,dp=16"),
    ("qwen3-30b-a3b", "megatron:tp=4,pp=2,ep=8,dp=8", "vllm:tp=8,dp=8"),
    # 16 nodes x 16 accelerators for training, as many for inference
    # (94 layers: 11 in the first and last stages, 12 in the others)
    ("qwen3-235b-a22b", "megatron:tp=4,pp=8,ep=8,dp=8,first=11,last=11", "vllm:tp=8,dp=32"),
    ("qwen3-235b-a22b", "megatron:tp=4,pp=8,ep=8,dp=8,first=11,last=11", "vllm:tp=4,dp=64"),
]


def simulate(model: str, src: str, dst: str, *, link_gbps: float = 50.0, dtype: str = "bfloat16",
             bucket_bytes: int = 64 << 20) -> dict[str, Any]:
    spec = model_spec(model, dtype)
    senders = side_layouts(spec, parse_side(src, "src"), SENDER, "src", dtype)
    receivers = side_layouts(spec, parse_side(dst, "dst"), RECEIVER, "dst", dtype)
    start = time.perf_counter()
    p = plan(senders, receivers, bucket_bytes=bucket_bytes, stats_only=True)
    plan_seconds = time.perf_counter() - start
    link = link_gbps * 1e9
    model_bytes = _model_bytes(senders)
    held0 = sum(s.num_bytes for s in senders[0].shards)
    gather = model_bytes - held0
    naive_bytes = gather + len(receivers) * model_bytes
    seconds = p.stats.max_bytes_per_rank / link
    naive = (gather + len(receivers) * model_bytes) / link
    bcast = (gather + model_bytes) / link
    return {
        "case": "simulate", "model": model, "src": src, "dst": dst, "senders": len(senders),
        "receivers": len(receivers), "model_bytes": model_bytes, "bytes_moved": p.stats.total_bytes,
        "bytes_min": bytes_min(receivers), "max_bytes_per_link": p.stats.max_bytes_per_link,
        "max_bytes_per_rank": p.stats.max_bytes_per_rank, "num_messages": p.stats.num_messages,
        "num_links": p.stats.num_links, "link_gbps": link_gbps, "seconds": round(seconds, 3),
        "naive_bytes": naive_bytes, "naive_seconds": round(naive, 3), "naive_bcast_seconds": round(bcast, 3),
        "speedup_vs_naive": round(naive / seconds, 1), "speedup_vs_bcast": round(bcast / seconds, 1),
        "plan_hash": p.plan_hash, "plan_seconds": round(plan_seconds, 1),
    }


def _model_bytes(senders) -> int:
    """Bytes of the canonical model: every canonical tensor once."""
    seen = {}
    for layout in senders:
        for s in layout.shards:
            seen.setdefault(s.canonical_name, s)
    total = 0
    for s in seen.values():
        n = s.itemsize
        for d in s.canonical_shape:
            n *= d
        total += n
    return total
