"""The prefix cache: the pure block-hash store, and the embedded engine reusing a stored prefix's KV (same
log-probs as computing it, fewer tokens through the model, nothing kept across a weight update)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.engines.prefix_cache import PrefixCache
from services.rollout.engines.sequence import Sampling
from services.rollout.engines.torch_engine import EngineConfig
from tests.rollout.test_engine import full_forward_logprobs, make_engine, tiny_model

BLOCK = 4


def kv_of(tokens: list[int], layers: int = 2):
    """Per-layer KV whose values say which token they belong to (so a returned slice can be checked)."""
    def make(n: int):
        col = torch.tensor(tokens[:n], dtype=torch.float32).view(1, n, 1)
        return [(col.clone() + layer, -col.clone()) for layer in range(layers)]
    return make


def test_lookup_returns_the_longest_stored_whole_block_prefix_shorter_than_the_context():
    cache = PrefixCache(budget_bytes=1 << 20, block=BLOCK)
    stored = list(range(10, 21))                      # 11 tokens: 8 stored (two blocks)
    assert cache.insert(stored, kv_of(stored))
    assert cache.lookup(list(range(10, 30)))[0] == 8
    n, kv, _ = cache.lookup(list(range(10, 16)) + [99, 98])   # shares one whole block
    assert n == 4 and kv[1][0].flatten().tolist() == [11.0, 12.0, 13.0, 14.0]
    assert cache.lookup(list(range(10, 18)))[0] == 4, "at least the last token is left to compute"
    assert cache.lookup([1, 2, 3, 4, 5, 6]) == (0, None, None)
    assert cache.stats.hits == 3 and cache.stats.hit_tokens == 16 and cache.stats.lookups == 4


def test_a_hash_match_is_verified_token_for_token(monkeypatch):
    cache = PrefixCache(budget_bytes=1 << 20, block=BLOCK)
    cache.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5]))
    monkeypatch.setattr(cache, "_chain", lambda context, blocks: [0] * blocks)  # every context collides
    assert cache.lookup([7, 7, 7, 7, 7]) == (0, None, None)


def test_the_byte_budget_evicts_the_least_recently_used_and_an_entry_too_big_is_not_stored():
    one = 2 * 2 * 8 * 4                                    # 2 layers, keys + values, 8 tokens of float32
    cache = PrefixCache(budget_bytes=2 * one, block=BLOCK)
    a, b, c = [list(range(s, s + 8)) for s in (100, 200, 300)]
    for ctx in (a, b):
        cache.insert(ctx, kv_of(ctx))
    assert cache.lookup(a + [1])[0] == 8                   # a is now the most recent
    cache.insert(c, kv_of(c))
    assert cache.lookup(b + [1])[0] == 0 and cache.lookup(a + [1])[0] == 8 and cache.lookup(c + [1])[0] == 8
    assert cache.bytes == 2 * one and cache.stats.evicted == 1
    assert not cache.insert(list(range(24)), kv_of(list(range(24))))   # 3x the per-entry bytes: over budget
    assert not cache.insert(a + [5], kv_of(a)), "a held prefix is not stored twice"
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.lookup(a + [1]) == (0, None, None)


def test_a_boundary_two_entries_share_stays_indexed_while_the_newer_lives():
    cache = PrefixCache(budget_bytes=1 << 20, block=BLOCK)
    older, newer = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    cache.insert(older, kv_of(older))
    cache.insert(newer, kv_of(newer))
    cache._evict_oldest()
    assert cache.lookup([1, 2, 3, 4, 0])[0] == 4 and cache.lookup(newer + [0])[0] == 8


def test_config_refuses_a_negative_budget():
    with pytest.raises(ValueError, match="engine.prefix_cache_mb"):
        EngineConfig(prefix_cache_mb=-1)


async def test_the_engine_reuses_a_shared_prefix_and_its_logprobs_are_the_full_forwards():
    model = tiny_model(0)
    engine = make_engine(model, prefix_cache_bytes=1 << 24)
    system = [(7 * i) % 50 + 2 for i in range(96)]           # a long shared prefix: 3 blocks of 32
    greedy = Sampling(temperature=0.0, max_new_tokens=6, stop_token_ids=())
    try:
        first = await asyncio.wait_for(engine.generate(system + [5, 6], greedy), 60)
        looked_up = engine.stats.prefix_cache_lookup_tokens
        assert engine.stats.prefix_cache_hit_tokens == 0 and engine.stats.prefix_cache_bytes > 0
        again = await asyncio.wait_for(engine.generate(system + [5, 6], greedy), 60)
        other = await asyncio.wait_for(asyncio.gather(engine.generate(system + [9, 10, 11], greedy),
                                                      engine.generate([3, 4], greedy)), 60)
        hits = engine.stats.prefix_cache_hit_tokens
        assert hits == 2 * 96 and engine.stats.prefix_cache_lookup_tokens == looked_up + 98 + 99 + 2
        assert again[0].output_ids == first[0].output_ids
        for prompt, seq in ((system + [5, 6], again[0]), (system + [9, 10, 11], other[0][0]), ([3, 4], other[1][0])):
            expected = full_forward_logprobs(model, prompt, seq.output_ids)
            torch.testing.assert_close(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=1e-4)
        await engine.pause_async()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        await engine.resume_async(version=1)
        after = await asyncio.wait_for(engine.generate(system + [5, 6], greedy), 60)
        assert engine.stats.prefix_cache_hit_tokens == hits, "a weight update drops every stored prefix"
        expected = full_forward_logprobs(model, system + [5, 6], after[0].output_ids)
        torch.testing.assert_close(torch.tensor(after[0].logprobs), expected, atol=1e-4, rtol=1e-4)
    finally:
        engine.stop()


async def test_rows_with_and_without_a_hit_in_one_batch_sample_as_without_the_cache():
    """Samples with a seed: the cached engine's tokens and log-probs are the uncached one's."""
    system = [(5 * i) % 40 + 2 for i in range(64)]
    sampling = Sampling(temperature=1.0, max_new_tokens=8, stop_token_ids=())
    prompts = [system + [5], system + [6, 7], [8, 9, 10], system[:40] + [11]]
    results = []
    for budget in (0, 1 << 24):
        engine = make_engine(tiny_model(1), prefix_cache_bytes=budget)
        try:
            await asyncio.wait_for(engine.generate(system + [1], sampling), 60)   # stores the prefix (if on)
            await engine.pause_async()    # every row queued before the next step: the same batches both times
            calls = [asyncio.ensure_future(engine.generate(p, sampling, n=2)) for p in prompts]
            while engine.num_waiting() < 2 * len(prompts):
                await asyncio.sleep(0.01)
            await engine.resume_async()
            results.append(await asyncio.wait_for(asyncio.gather(*calls), 60))
        finally:
            engine.stop()
        assert engine.stats.prefix_cache_hit_tokens == (0 if budget == 0 else 2 * 64 + 32)
    for plain, cached in zip(*results, strict=True):
        for a, b in zip(plain, cached, strict=True):
            assert a.output_ids == b.output_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)
