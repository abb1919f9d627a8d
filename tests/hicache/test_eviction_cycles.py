"""Eviction under many sessions, simulated on fake tiers through the real `CacheManager`
(tests/hicache/eviction_sim.py; `benchmarks/eviction.py` prints the whole table).

Conversations that come back in turn, with L1 + L2 smaller than round 0 alone, defeat recency:
LRU (and LFU, whose hit counts are all 0 when round 0 must be evicted) evicts exactly the
conversation that comes next. The default `next_use` must keep a stable subset there, and match
the best of the other policies where recency matters. All policies play the same token streams."""
from __future__ import annotations

import pytest
import torch

import cache_fakes as fakes
import eviction_sim as sim
from hicache.eviction import DEFAULT
from hicache.tree import RadixTree

WORKLOADS = {w.name: w for w in sim.workloads()}


def later(rates: list[float]) -> tuple[float, float]:
    """Mean hit rate from round 1 on, and the lowest of those rounds."""
    return sum(rates[1:]) / len(rates[1:]), min(rates[1:])


@pytest.mark.parametrize("name", ["cyclic-64", "cyclic-64-long-first", "cyclic-64-long-first-primed"])
def test_default_keeps_a_stable_subset_where_recency_collapses(name):
    w = WORKLOADS[name]
    assert sim.working_set(w) * (w.l1 + w.l2) < sum(q.prompt + q.answer for q in w.rounds[0]), "round 0 must overflow L1 + L2"
    best, lru, aging = (sim.play(p, w) for p in (DEFAULT, "lru", "lfu_aging"))
    print(f"hit rate by round: {DEFAULT} {[round(r, 2) for r in best]}, lru {[round(r, 2) for r in lru]}, "
          f"lfu_aging {[round(r, 2) for r in aging]}")
    mean, low = later(best)
    assert low >= 0.75 * mean and mean >= 0.4, best
    assert later(lru)[0] < 0.05 and later(aging)[0] < 0.05, "the workload no longer shows the collapse"


@pytest.mark.parametrize("name", ["few-fit", "agent", "rolling-sessions", "shared-prompt-users", "zipf-64",
                                  "cyclic-shared-prompt"])
def test_default_is_within_a_small_margin_of_the_best_elsewhere(name):
    w = WORKLOADS[name]
    means = {p: later(sim.play(p, w))[0] for p in (DEFAULT, "lru", "lfu_aging")}
    assert means[DEFAULT] >= max(means.values()) - 0.02, means


def test_lfu_aging_halves_hit_counts_once_the_cache_turned_over():
    ps = sim.PS
    alloc = fakes.FakeAllocator(4, ps)
    tree = RadixTree(alloc, ps, "lfu_aging")
    hot = list(range(ps))
    tree.insert(hot, alloc.alloc(ps))
    for _ in range(4):
        tree.insert(hot, torch.tensor(list(tree.match(hot).device_slots)))
    node = tree.match(hot).last_node
    assert node.hit_count == 4
    for i in range(3):  # three one-off pages: L1 (4 pages) turns over once they are all evicted
        tree.insert([100 + i] * ps, alloc.alloc(ps))
    tree.evict(3 * ps)
    assert node.hit_count == 4  # not yet: 3 of 4 pages deleted
    tree.insert([200] * ps, alloc.alloc(ps))
    tree.evict(ps)
    assert node.parent is not None and node.hit_count == 2, "the hot page outranks one-off pages, halved once"
