"""Unit tests of the radix tree (hicache/tree.py) and eviction strategies, on a fake allocator."""
from __future__ import annotations


import pytest
import torch

from hicache.eviction import get_strategy
from hicache.tree import RadixTree
from cache_fakes import FakeAllocator




def make(page_size=1, num_pages=64, policy="lru", disabled=False):
    alloc = FakeAllocator(num_pages, page_size)
    return alloc, RadixTree(alloc, page_size, policy, disabled)


def fresh(alloc, n):
    """Slots for n tokens, as a request would hold them: whole pages, then cut to n."""
    ps = alloc.page_size
    pages = alloc.alloc(-(-n // ps) * ps)
    assert pages is not None
    return pages[:n], pages


def insert_new(tree, alloc, tokens, namespace=""):
    """Insert with all-fresh slots, freeing what the tree did not take. Returns (n_present, slots)."""
    slots, pages = fresh(alloc, len(tokens))
    n_present = tree.insert(tokens, slots, namespace)
    aligned = len(tokens) // alloc.page_size * alloc.page_size
    alloc.free(pages[:n_present])
    alloc.free(pages[aligned:] if aligned < len(pages) else pages[:0])
    tree.check_integrity()
    return n_present, slots


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_match_insert_split_at_page_boundaries(ps):
    alloc, tree = make(ps)
    a = list(range(100, 100 + 3 * ps))
    assert tree.match(a).device_slots.numel() == 0
    assert tree.match(a).last_node is tree.root
    n_present, slots = insert_new(tree, alloc, a)
    assert n_present == 0
    assert torch.equal(tree.match(a).device_slots, slots)

    # Diverge inside the second page: the match is one page and splits the node there.
    b = a[:ps] + [7] + a[ps + 1: 2 * ps] + [7] * ps  # even when the rest of page 2 agrees
    m = tree.match(b)
    assert torch.equal(m.device_slots, slots[:ps])
    assert m.last_node.key == tuple(a[:ps]) and len(m.last_node.children) == 1
    tree.check_integrity()
    n_present, b_slots = insert_new(tree, alloc, b)
    assert n_present == ps
    assert torch.equal(tree.match(b).device_slots, torch.cat([slots[:ps], b_slots[ps:]]))
    assert torch.equal(tree.match(a).device_slots, slots)  # a still whole after the split
    assert tree.total_tokens() == 5 * ps


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_match_of_prefix_and_extension(ps):
    alloc, tree = make(ps)
    a = [1, 2, 3] * (2 * ps)  # 6 pages
    _, slots = insert_new(tree, alloc, a)
    assert torch.equal(tree.match(a[: 2 * ps]).device_slots, slots[: 2 * ps])
    assert torch.equal(tree.match(a + [9] * (3 * ps)).device_slots, slots)
    assert torch.equal(tree.match(torch.tensor(a[: 4 * ps])).device_slots, slots[: 4 * ps])
    tree.check_integrity()


def test_partial_last_page_never_shared():
    alloc, tree = make(4)
    a = list(range(10))  # 2 whole pages + 2 tokens
    n_present, slots = insert_new(tree, alloc, a)
    assert n_present == 0 and tree.total_tokens() == 8
    assert torch.equal(tree.match(a).device_slots, slots[:8])
    assert torch.equal(tree.match(a[:7]).device_slots, slots[:4])  # 7 tokens: only 1 whole page
    assert tree.match(a[:3]).device_slots.numel() == 0
    assert tree.match([0, 1, 2, 9]).device_slots.numel() == 0  # differs inside the first page
    n_present, _ = insert_new(tree, alloc, a[:6])  # the page-aligned part is present
    assert n_present == 4


def test_duplicate_insert_returns_n_present_and_takes_no_ownership():
    alloc, tree = make(2)
    a = [5, 6, 7, 8]
    _, slots = insert_new(tree, alloc, a)
    n_present, slots2 = insert_new(tree, alloc, a + [9, 10, 11])  # insert_new frees slots2[:4] and the tail
    assert n_present == 4
    m = tree.match(a + [9, 10])
    assert torch.equal(m.device_slots, torch.cat([slots, slots2[4:6]]))
    # An exact duplicate: nothing taken, nothing changes, hit counts go up.
    hits = m.last_node.hit_count
    assert insert_new(tree, alloc, a + [9, 10])[0] == 6
    assert m.last_node.hit_count == hits + 1
    assert tree.total_tokens() == 6


def test_request_flow_reuses_matched_slots():
    """The scheduler's flow: match, lock, compute the rest, insert, unlock."""
    alloc, tree = make(1, 16)
    insert_new(tree, alloc, [1, 2, 3])
    m = tree.match([1, 2, 3, 4, 5])
    tree.lock(m.last_node)
    new = alloc.alloc(2)
    tree.check_integrity(held_slots=new)
    assert tree.insert([1, 2, 3, 4, 5], torch.cat([m.device_slots, new])) == 3
    tree.unlock(m.last_node)
    tree.check_integrity()
    assert tree.total_tokens() == 5 and alloc.num_free_tokens() == 11


def test_lock_prevents_eviction_and_counts():
    alloc, tree = make(1, 32)
    insert_new(tree, alloc, [1, 2, 3, 4])
    insert_new(tree, alloc, [1, 2, 8, 9, 10])
    m = tree.match([1, 2, 3, 4])
    tree.lock(m.last_node)
    assert (tree.locked_tokens(), tree.evictable_tokens()) == (4, 3)
    tree.check_integrity()
    assert tree.evict(100) == 3
    assert tree.total_tokens() == 4 and tree.evictable_tokens() == 0
    assert tree.evict(1) == 0
    tree.check_integrity()
    tree.unlock(m.last_node)
    assert tree.evictable_tokens() == 4
    assert tree.evict(1) == 2  # one leaf: [3, 4]
    assert tree.evict(10) == 2
    assert alloc.num_free_tokens() == 32
    tree.check_integrity()


def test_lock_survives_split_of_locked_node():
    alloc, tree = make(1, 32)
    insert_new(tree, alloc, [1, 2, 3, 4])
    node = tree.match([1, 2, 3, 4]).last_node
    tree.lock(node)
    tree.lock(node)
    tree.match([1, 2, 9])  # splits the locked node after 2 tokens
    tree.check_integrity()
    assert node.parent.lock_ref == 2 and node.parent.direct_locks == 0
    assert tree.locked_tokens() == 4
    tree.unlock(node)
    tree.unlock(node)
    assert tree.locked_tokens() == 0 and tree.evictable_tokens() == 4
    with pytest.raises(RuntimeError, match="without a matching lock"):
        tree.unlock(node)
    tree.check_integrity()


def test_lock_of_root_is_noop_and_deleted_node_raises():
    alloc, tree = make(1, 8)
    tree.lock(tree.root)
    tree.unlock(tree.root)
    insert_new(tree, alloc, [1, 2])
    node = tree.match([1, 2]).last_node
    tree.evict(2)
    with pytest.raises(RuntimeError, match="deleted"):
        tree.lock(node)


def test_evict_cascades_to_parents():
    alloc, tree = make(1, 32)
    insert_new(tree, alloc, [1, 2, 3])
    insert_new(tree, alloc, [1, 2, 4])
    # Leaves [3] and [4] go first, then their parent [1, 2] becomes a leaf.
    assert tree.evict(3) == 4
    assert tree.total_tokens() == 0
    tree.check_integrity()


def _three_leaves(policy):
    alloc, tree = make(1, 32, policy)
    for first in (1, 2, 3):
        insert_new(tree, alloc, [first, 0])
    return alloc, tree


def test_lru_evicts_least_recently_used():
    alloc, tree = _three_leaves("lru")
    tree.match([1, 0])  # 1 now most recent; 2 is oldest
    assert tree.evict(1) == 2
    assert tree.match([2, 0]).device_slots.numel() == 0
    assert tree.match([1, 0]).device_slots.numel() == 2
    assert tree.match([3, 0]).device_slots.numel() == 2
    tree.check_integrity()


def test_lfu_evicts_least_frequently_used_then_oldest():
    alloc, tree = _three_leaves("lfu")
    insert_new(tree, alloc, [1, 0])
    insert_new(tree, alloc, [2, 0])  # hits: 1 -> 1, 2 -> 1, 3 -> 0
    tree.match([3, 0])
    assert tree.evict(1) == 2
    assert tree.match([3, 0]).device_slots.numel() == 0  # fewest hits although most recent
    assert tree.evict(1) == 2
    assert tree.match([1, 0]).device_slots.numel() == 0  # tie on hits: the older goes
    tree.check_integrity()


def test_next_use_evicts_expired_then_newest_unreused_then_farthest_next_use():
    alloc, tree = make(1, 64, "next_use")
    for first in (1, 2, 3, 4):  # four conversations, first turns
        insert_new(tree, alloc, [first, 0])
    insert_new(tree, alloc, [1, 0, 5])  # 1 comes back after 4 uses: its next turn takes its pace
    insert_new(tree, alloc, [2, 0, 5])  # 2 too, after 4 uses
    leaf1 = tree.match([1, 0, 5]).last_node
    assert leaf1.reuse_gap == leaf1.parent.reuse_gap == 4 and tree.use_clock.typical_gap == 4
    # never reused (3 and 4): the newest first, so that newcomers do not push out older residents
    assert tree.evict(1) == 2 and tree.match([4, 0]).device_slots.numel() == 0
    assert tree.evict(1) == 2 and tree.match([3, 0]).device_slots.numel() == 0
    # reused at a pace: the farthest predicted next use (last use + gap) first: 2's, then 1's
    assert tree.evict(1) == 1 and tree.match([2, 0, 5]).device_slots.numel() == 2
    insert_new(tree, alloc, [6, 0])
    for _ in range(40):  # 6 comes back at a pace of 1; 1 and 2 are idle for more than 8 gaps
        insert_new(tree, alloc, [6, 0])
    assert tree.evict(1) == 1 and tree.match([1, 0, 5]).device_slots.numel() == 2  # expired: oldest first
    tree.check_integrity()


def test_next_use_new_branch_under_a_shared_prefix_is_unreused():
    alloc, tree = make(1, 64, "next_use")
    for user in (1, 2, 3):
        insert_new(tree, alloc, [9, 9, user])
    insert_new(tree, alloc, [9, 9, 4])  # the shared prompt has three branches already
    shared = tree.match([9, 9]).last_node
    assert shared.reuse_gap > 0 and tree.match([9, 9, 4]).last_node.reuse_gap == 0


def test_unknown_policy_lists_choices():
    with pytest.raises(ValueError, match=r"\['lfu', 'lfu_aging', 'lru', 'next_use'\]"):
        get_strategy("fifo")
    with pytest.raises(ValueError):
        make(policy="mru")


def test_namespaces_are_isolated():
    alloc, tree = make(2, 32)
    a = [1, 2, 3, 4]
    _, sa = insert_new(tree, alloc, a, "tenant-a")
    assert tree.match(a).device_slots.numel() == 0
    assert tree.match(a, "tenant-b").device_slots.numel() == 0
    n_present, sb = insert_new(tree, alloc, a, "tenant-b")
    assert n_present == 0  # identical tokens, yet no sharing
    assert torch.equal(tree.match(a, "tenant-a").device_slots, sa)
    assert torch.equal(tree.match(a, "tenant-b").device_slots, sb)
    assert tree.match(a, "tenant-b").last_node is not tree.match(a, "tenant-a").last_node
    assert tree.total_tokens() == 8
    assert tree.evict(8) == 8  # eviction spans namespaces
    tree.check_integrity()
    assert alloc.num_free_tokens() == 64


def test_disabled_tree_caches_nothing():
    alloc, tree = make(1, 8, disabled=True)
    slots = alloc.alloc(3)
    assert tree.insert([1, 2, 3], slots) == 0 and tree.total_tokens() == 0
    tree.check_integrity(held_slots=slots)  # the tree took nothing: the caller frees it all
    alloc.free(slots)
    m = tree.match([1, 2, 3])
    assert m.device_slots.numel() == 0 and m.last_node is tree.root
    assert alloc.num_free_tokens() == 8


def test_reset_frees_everything_and_refuses_when_locked():
    alloc, tree = make(4, 16)
    insert_new(tree, alloc, list(range(12)))
    insert_new(tree, alloc, list(range(4)) + [9] * 8, "x")
    node = tree.match(list(range(8))).last_node
    tree.lock(node)
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.unlock(node)
    tree.reset()
    assert tree.total_tokens() == 0 and alloc.num_free_tokens() == 64
    assert tree.match(list(range(12))).device_slots.numel() == 0
    tree.check_integrity()
    with pytest.raises(RuntimeError, match="deleted"):
        tree.lock(node)


def test_insert_validates_slots():
    alloc, tree = make(1, 8)
    with pytest.raises(ValueError):
        tree.insert([1, 2], torch.tensor([0], dtype=torch.int64))
    with pytest.raises(ValueError):
        tree.insert([1], torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError):
        RadixTree(alloc, page_size=2)


def test_check_integrity_catches_leaks_and_double_ownership():
    alloc, tree = make(1, 8)
    held = alloc.alloc(2)
    with pytest.raises(AssertionError, match="leak"):
        tree.check_integrity()
    tree.check_integrity(held_slots=held)
    tree.insert([1, 2], held)
    with pytest.raises(AssertionError, match="both tree and held"):
        tree.check_integrity(held_slots=held)
    tree.check_integrity()
    node = tree.match([1, 2]).last_node
    node.lock_ref = 1
    with pytest.raises(AssertionError, match="lock_ref"):
        tree.check_integrity()


@pytest.mark.parametrize("ps", [1, 4])
def test_match_diverging_at_every_page_and_offset(ps):
    """One long node; queries that leave it at every page and every offset inside a page."""
    alloc, tree = make(ps, 32)
    a = [p // ps % 7 + 1 for p in range(10 * ps)]  # 10 pages, one node
    _, slots = insert_new(tree, alloc, a)
    for at in range(len(a) + 1):
        query = a[:at] + [0] * (2 * ps)  # token 0 never occurs in a
        expect = at // ps * ps
        assert torch.equal(tree.match(query).device_slots, slots[:expect]), at
        tree.check_integrity()
    assert torch.equal(tree.match(a).device_slots, slots)
