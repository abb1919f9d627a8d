"""Eviction under many sessions that come back in turn, simulated on fake tiers through the
`CacheManager`: conversations each append a question and an answer per round, one after the
other, with L1 + L2 holding well under their final working set. LRU evicts exactly the
conversation that comes next; `lfu_aging` must keep a hit rate well above it (both policies played in
the same run, on the same token streams)."""
from __future__ import annotations

import random

import torch

from hicache.controller import CacheController
from hicache.manager import CacheManager, Lease
from hicache.tree import RadixTree
import cache_fakes as fakes

PS = 4
CONVERSATIONS, ROUNDS, FIRST, QUESTION, ANSWER = 24, 6, 64, 16, 8


def play(policy: str, streams: list[list[int]], device_pages: int, host_pages: int) -> list[float]:
    """Plays the conversations round by round; returns the hit rate (cached / prompt tokens) of
    each round."""
    alloc = fakes.FakeAllocator(device_pages, PS)
    host_pool = fakes.FakeHostPool(host_pages, PS)
    xfer = fakes.FakeTransfer({}, {})
    tree = RadixTree(alloc, PS, policy, host_allocator=host_pool.allocator)
    cache = CacheManager(CacheController(tree, host_pool, xfer, load_back_min_tokens=1), fakes.FakeTable(2))
    rates, length = [], FIRST
    for _ in range(ROUNDS):
        hit = prompt = 0
        for stream in streams:
            tokens = stream[:length]
            lease = Lease("", owner=tokens)
            got = cache.admit(lease, cache.match(tokens[:-1], ""), PS)
            assert got is not None and cache.grow(lease, length + ANSWER)
            cache.poll([])
            hit, prompt = hit + got.prefix, prompt + length
            cache.release(lease, stream[:length + ANSWER], length)
        rates.append(hit / prompt)
        length += ANSWER + QUESTION
    return rates


def test_lfu_aging_keeps_hits_where_lru_thrashes_on_cyclic_sessions():
    rng = random.Random(7)
    final = FIRST + ROUNDS * (ANSWER + QUESTION)
    streams = [[rng.randrange(1, 50_000) for _ in range(final)] for _ in range(CONVERSATIONS)]
    working_set_pages = CONVERSATIONS * final // PS
    device_pages, host_pages = working_set_pages // 10, working_set_pages // 2
    lru = play("lru", streams, device_pages, host_pages)
    aging = play("lfu_aging", streams, device_pages, host_pages)
    later_lru, later_aging = sum(lru[1:]) / (ROUNDS - 1), sum(aging[1:]) / (ROUNDS - 1)
    print(f"hit rate by round: lru {[round(r, 2) for r in lru]}, lfu_aging {[round(r, 2) for r in aging]}")
    assert lru[0] == aging[0] == 0
    assert later_aging >= 2 * later_lru, (lru, aging)
    # the working set grows each round, so hits fall, but never collapse as LRU's do
    assert min(aging[1:]) >= 0.5 * aging[1] and lru[-1] < 0.5 * aging[-1], (lru, aging)


def test_lfu_aging_halves_hit_counts_once_the_cache_turned_over():
    alloc = fakes.FakeAllocator(4, PS)
    tree = RadixTree(alloc, PS, "lfu_aging")
    hot = list(range(PS))
    tree.insert(hot, alloc.alloc(PS))
    for _ in range(4):
        tree.insert(hot, torch.tensor(list(tree.match(hot).device_slots)))
    node = tree.match(hot).last_node
    assert node.hit_count == 4
    for i in range(3):  # three one-off pages: L1 (4 pages) turns over once they are all evicted
        tree.insert([100 + i] * PS, alloc.alloc(PS))
    tree.evict(3 * PS)
    assert node.hit_count == 4  # not yet: 3 of 4 pages deleted
    tree.insert([200] * PS, alloc.alloc(PS))
    tree.evict(PS)
    assert node.parent is not None and node.hit_count == 2, "the hot page outranks one-off pages, halved once"
