"""The planner: exactly-once coverage, determinism, load sharing, buckets, stats, errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.weight_exchange.client.layout import RECEIVER, SENDER
from services.weight_exchange.client.layouts.model import model_spec
from services.weight_exchange.client.layouts.topology import parse_side, side_layouts
from services.weight_exchange.client.regions import Region, grid, split
from services.weight_exchange.planner import PlanError, bytes_min, plan


def layouts(model: str, src: str, dst: str):
    spec = model_spec(model)
    return (side_layouts(spec, parse_side(src), SENDER, "src"), side_layouts(spec, parse_side(dst), RECEIVER, "dst"))


def assert_exactly_once(senders, receivers, p) -> None:
    counts = {(r.rank_id, name): np.zeros(shape, dtype=np.int32)
              for r in receivers for name, (shape, _) in r.local_tensors().items()}
    sources = {(s.rank_id, name): shape for s in senders for name, (shape, _) in s.local_tensors().items()}
    for t in p.transfers:
        counts[(t.dst, t.dst_local)][t.dst_region.slices()] += 1
        assert t.src_region.within(sources[(t.src, t.src_local)])
        assert t.src_region.numel == t.dst_region.numel
    for r in receivers:
        needed = {name: np.zeros(shape, dtype=np.int32) for name, (shape, _) in r.local_tensors().items()}
        for s in r.shards:
            needed[s.local_name][s.local_region.slices()] += 1
        for name, need in needed.items():
            assert (counts[(r.rank_id, name)] == need).all(), (r.rank_id, name)
            assert need.max() <= 1


CASES = [
    ("tiny-qwen3", "megatron:tp=2", "vllm:tp=4"),
    ("tiny-qwen3", "megatron:tp=4,pp=2", "vllm:tp=2,dp=3"),
    ("tiny-qwen3", "fsdp2:dp=3", "vllm:tp=4"),
    ("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=4,dp=2,etp=1", "sglang:tp=8,ep=4,dp=2"),
    ("tiny-qwen3-moe", "hf", "vllm:tp=8"),
    ("tiny-llama-gqa9", "megatron:tp=3", "vllm:tp=3"),
    ("tiny-qwen2", "megatron:tp=2,dp=2", "embedded:dp=2"),
]


@pytest.mark.parametrize("model,src,dst", CASES)
def test_every_receiver_byte_exactly_once(model, src, dst):
    senders, receivers = layouts(model, src, dst)
    p = plan(senders, receivers, bucket_bytes=4096)
    assert_exactly_once(senders, receivers, p)
    assert p.stats.total_bytes == bytes_min(receivers)
    assert all(t.num_bytes <= 4096 or t.dst_region.sizes[-1] * 4 > 4096 for t in p.transfers)


def test_plan_is_deterministic():
    senders, receivers = layouts("tiny-qwen3-moe", "megatron:tp=2,pp=2,ep=2,etp=1", "vllm:tp=4,dp=2")
    first = plan(senders, receivers)
    random.Random(0).shuffle(senders)
    random.Random(1).shuffle(receivers)
    for layout in senders + receivers:
        random.Random(2).shuffle(layout.shards)
    second = plan(senders, receivers)
    assert first.plan_hash == second.plan_hash and first.transfers == second.transfers


def test_data_parallel_replicas_share_the_load():
    senders, receivers = layouts("tiny-qwen3", "megatron:tp=2,dp=2", "vllm:tp=2,dp=2")
    p = plan(senders, receivers)
    sent = p.stats.bytes_per_sender
    assert len(sent) == 4
    assert max(sent.values()) <= 1.2 * min(sent.values())
    one, _ = layouts("tiny-qwen3", "megatron:tp=2", "vllm:tp=2")
    assert plan(one, receivers).stats.max_bytes_per_rank >= 1.9 * p.stats.max_bytes_per_rank / 1.2


def test_buckets_and_stats():
    senders, receivers = layouts("tiny-qwen3", "megatron:tp=2", "vllm:tp=2")
    p = plan(senders, receivers, bucket_bytes=64 << 10)
    per_bucket: dict = {}
    for t in p.transfers:
        per_bucket[(t.src, t.dst, t.bucket)] = per_bucket.get((t.src, t.dst, t.bucket), 0) + t.num_bytes
    assert max(per_bucket.values()) <= 64 << 10
    assert p.stats.num_buckets == len(per_bucket) and p.stats.num_messages == len(p.transfers)
    # same TP: rank r pulls from rank r, plus the vocab rows that Megatron's padding (to 256 per rank) and
    # vLLM's (to 64, 160 rows per rank) place on different ranks
    assert p.stats.num_links == 3
    assert p.stats.max_bytes_per_link == max(p.stats.bytes_per_receiver.values())


def test_errors_name_ranks_and_tensors():
    senders, receivers = layouts("tiny-qwen3", "megatron:tp=2", "vllm:tp=2")
    senders[0].shards = [s for s in senders[0].shards if s.canonical_name != "model.norm.weight"]
    senders[1].shards = [s for s in senders[1].shards if s.canonical_name != "model.norm.weight"]
    with pytest.raises(PlanError, match="model.norm.weight: receiver dst-0 needs it and no sender holds it"):
        plan(senders, receivers)
    senders, receivers = layouts("tiny-qwen3", "megatron:tp=2", "vllm:tp=2")
    senders[0].shards = [s for s in senders[0].shards if "layers.1.self_attn.q_proj" not in s.canonical_name]
    with pytest.raises(PlanError, match=r"q_proj.weight: receiver dst-0 needs region \[0:64"):
        plan(senders, receivers)
    other, _ = layouts("tiny-qwen3-moe", "hf", "vllm:tp=1")
    with pytest.raises(PlanError, match="model.embed_tokens.weight: receiver dst-0 has shape"):
        plan(other, receivers)


def test_regions():
    box = Region((0, 0), (10, 4))
    cells = list(grid(box, [Region((0, 0), (5, 4)), Region((3, 0), (7, 4))]))
    assert [c.offsets[0] for c in cells] == [0, 3, 5] and sum(c.numel for c in cells) == box.numel
    pieces = split(Region((2, 0), (10, 8)), 4, 100)
    assert sum(p.numel for p in pieces) == 80 and all(p.numel * 4 <= 100 for p in pieces)
    assert pieces[0].offsets == (2, 0)
    assert split(Region((0,), (1,)), 4, 1) == [Region((0,), (1,))]
