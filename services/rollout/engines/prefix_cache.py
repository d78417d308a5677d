"""KV of prompt prefixes kept across requests, so a long shared prefix (an agent's system prompt and tool schemas,
a session's earlier turns, a GRPO prompt's template) is computed once, not once per request.

Block hashes, as vLLM's automatic prefix caching: a context's first k*BLOCK tokens hash as a chain (block i's hash
covers blocks 0..i), and every boundary of a stored entry indexes it, so a lookup finds the longest stored prefix
of a new context in one pass over its blocks. A hit is verified token for token (a hash collision costs a miss,
never a wrong KV). Entries hold their own copies of the KV ([kv_heads, tokens, head_dim] per layer, the cache's
dtype) and are evicted least-recently-used past a byte budget. The engine clears the cache at every weight update:
KV computed under old weights is not the new policy's.

No model here: the runner hands in KV tensors and gets them back, so the policy is testable on its own.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import torch

BLOCK = 32  # tokens per hash block: the granularity of a hit


@dataclasses.dataclass
class PrefixCacheStats:
    lookups: int = 0         # contexts looked up (one per distinct context prefilled)
    hits: int = 0            # ... that found a stored prefix
    hit_tokens: int = 0      # prompt tokens not prefilled thanks to a hit
    lookup_tokens: int = 0   # prompt tokens of every context looked up
    inserted: int = 0        # entries stored
    evicted: int = 0         # entries dropped for the byte budget
    cleared: int = 0         # times the whole cache was dropped (weight updates)


@dataclasses.dataclass(eq=False)
class _Entry:
    tokens: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]   # per layer: keys, values [kv_heads, len(tokens), head_dim]
    routes: torch.Tensor | None                    # MoE routing replay: the tokens' routed experts, when recorded
    nbytes: int
    boundaries: list[int]                          # the chain hashes that index this entry


KVOf = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]  # tokens -> per-layer KV of the first `tokens`


class PrefixCache:
    def __init__(self, budget_bytes: int, block: int = BLOCK) -> None:
        assert budget_bytes > 0 and block > 0
        self.budget_bytes = budget_bytes
        self.block = block
        self.stats = PrefixCacheStats()
        self.bytes = 0
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # id -> entry, LRU first
        self._index: dict[int, _Entry] = {}  # chain hash of a block boundary -> the newest entry holding it

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, context: Sequence[int], blocks: int) -> list[int]:
        hashes, h = [], 0
        for i in range(blocks):
            h = hash((h, tuple(context[i * self.block:(i + 1) * self.block])))
            hashes.append(h)
        return hashes

    def lookup(self, context: Sequence[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None,
                                                      torch.Tensor | None]:
        """The longest stored prefix of `context` shorter than it (a step must compute at least its last token):
        (its length, per-layer KV views of that length, its routed experts if stored), or (0, None, None)."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(context)
        hashes = self._chain(context, (len(context) - 1) // self.block)
        for blocks in range(len(hashes), 0, -1):
            entry = self._index.get(hashes[blocks - 1])
            n = blocks * self.block
            if entry is not None and entry.tokens[:n] == tuple(context[:n]):
                self._entries.move_to_end(id(entry))
                self.stats.hits += 1
                self.stats.hit_tokens += n
                return n, [(k[:, :n], v[:, :n]) for k, v in entry.kv], \
                    None if entry.routes is None else entry.routes[:n]
        return 0, None, None

    def insert(self, context: Sequence[int], kv_of: KVOf, routes: torch.Tensor | None = None) -> bool:
        """Store the KV of `context`'s longest whole-block prefix unless an entry already holds it (or it would
        not fit the budget at all); `kv_of(n)` returns copies of the first n tokens' KV; `routes`, the context's
        routed experts per token (MoE routing replay), are stored beside it. True if stored."""
        blocks = len(context) // self.block
        if not blocks:
            return False
        n = blocks * self.block
        hashes = self._chain(context, blocks)
        held = self._index.get(hashes[-1])
        if held is not None and held.tokens[:n] == tuple(context[:n]):
            self._entries.move_to_end(id(held))
            return False
        kv = kv_of(n)
        routes = None if routes is None else routes[:n].clone()
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv) + (0 if routes is None else routes.nbytes)
        if nbytes > self.budget_bytes:
            return False
        while self.bytes + nbytes > self.budget_bytes:
            self._evict_oldest()
        entry = _Entry(tuple(context[:n]), kv, routes, nbytes, hashes)
        self._entries[id(entry)] = entry
        for h in hashes:
            self._index[h] = entry
        self.bytes += nbytes
        self.stats.inserted += 1
        return True

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        for h in entry.boundaries:
            if self._index.get(h) is entry:  # a newer entry may hold the same boundary: it stays indexed
                del self._index[h]
        self.bytes -= entry.nbytes
        self.stats.evicted += 1

    def clear(self) -> None:
        if self._entries:
            self.stats.cleared += 1
        self._entries.clear()
        self._index.clear()
        self.bytes = 0
