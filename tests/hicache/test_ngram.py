"""The n-gram index over the radix tree's tokens (hicache/ngram.py), fed by a real tree on a fake
allocator: what it proposes after inserts, splits, evictions and resets, and its bound."""
from __future__ import annotations

import random

from hicache.ngram import NgramIndex
from hicache.tree import RadixTree
from cache_fakes import FakeAllocator


def make(page_size=1, num_pages=256, capacity=10_000, windows=(1, 3)):
    alloc = FakeAllocator(num_pages, page_size)
    tree = RadixTree(alloc, page_size, "lru")
    index = NgramIndex(*windows, capacity)
    tree.observe(index)
    return alloc, tree, index


def insert(tree, alloc, tokens, namespace=""):
    n = len(tokens) // alloc.page_size * alloc.page_size
    slots = alloc.alloc(n)
    present = tree.insert(tokens[:n], slots, namespace)
    alloc.free(slots[:present])
    tree.check_integrity()


def test_proposes_what_followed_the_longest_tail_and_crosses_nodes():
    alloc, tree, index = make()
    insert(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert index.propose([9, 2, 3], "", 4) == ([4, 5, 6, 7], 2)
    assert index.propose([9, 9, 7], "", 4) == ([8], 1)
    assert index.propose([42], "", 4) == ([], 0)
    insert(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # a child continuing the path
    assert index.propose([5, 6], "", 5) == ([7, 8, 9, 10, 11], 2)
    assert index.propose([5, 6], "other", 5) == ([], 0)  # namespaces are apart


def test_entries_survive_splits_and_go_with_their_nodes():
    alloc, tree, index = make()
    insert(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    insert(tree, alloc, [1, 2, 3, 4, 90, 91, 92])  # splits the first leaf after 4 tokens
    tree.check_integrity()
    assert index.propose([1, 2], "", 3) in (([3, 4, 5], 2), ([3, 4, 90], 2))
    assert index.propose([5, 6], "", 2) == ([7, 8], 2)
    assert index.propose([90], "", 2) == ([91, 92], 1)
    tree.evict(7)  # the two leaves below the split go; the shared prefix [1..4] stays
    tree.check_integrity()
    assert index.propose([5, 6], "", 2) == ([], 0)
    assert index.propose([90], "", 2) == ([], 0)
    assert index.propose([1, 2], "", 3) == ([3, 4], 2)  # the split-off part kept its entries
    assert index.entries == 3 + 2 + 1  # [1..4]: n-grams of windows 1..3 ending before positions 1..3
    tree.evict(100)
    assert index.propose([1, 2], "", 3) == ([], 0) and index.entries == 0


def test_bounded_and_linear_in_the_tokens_added():
    alloc, tree, index = make(page_size=4, num_pages=512, capacity=300)
    rnd = random.Random(0)
    for _ in range(30):
        insert(tree, alloc, [rnd.randrange(1000) for _ in range(32)])
        assert index.entries <= 300
    # every position of a leaf is one entry per window (fewer only at the root): linear in tokens
    alloc2, tree2, index2 = make(page_size=4, num_pages=512)
    insert(tree2, alloc2, list(range(100, 164)))
    assert index2.entries == 3 * 64 - (1 + 2 + 3)


def test_reset_clears_and_l2_nodes_keep_their_entries():
    alloc, tree, index = make()
    insert(tree, alloc, [1, 2, 3, 4, 5])
    tree.reset()
    assert index.propose([1, 2], "", 2) == ([], 0) and index.entries == 0
    host = FakeAllocator(64, 1)
    tree = RadixTree(alloc, 1, "lru", host_allocator=host)
    tree.observe(index)
    insert(tree, alloc, [1, 2, 3, 4, 5])
    node = next(tree.nodes())
    tree.attach_host(node, host.alloc(5))
    tree.evict(5)  # L1 copy dropped; the node stays on L2
    assert node.device_slots is None and index.propose([1, 2], "", 2) == ([3, 4], 2)
    tree.evict_host(5)
    assert index.propose([1, 2], "", 2) == ([], 0)
