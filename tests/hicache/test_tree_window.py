"""The window policy (hicache/window.py) over a tree on an L1 that keeps the windowed layers' KV
apart (`WindowedAllocator`): matches end where the window before them is held, passing through
tombstones, and the integrity check accounts for window parts."""
from __future__ import annotations

import pytest
import torch

from cache_fakes import FakeAllocator
from hicache.tiers.gpu.allocator import WindowedAllocator
from hicache.tree import RadixTree
from hicache.window import WindowPolicy

PS, W = 4, 8


def cached(host: bool = False):
    """A tree holding one 24-token sequence whose first 12 tokens are tombstones."""
    alloc = WindowedAllocator(16, 8, PS, W)
    tree = RadixTree(alloc, PS, host_allocator=FakeAllocator(16, PS) if host else None)
    seq = list(range(100, 124))
    slots = alloc.alloc(24)
    assert tree.insert(seq, slots) == 0
    alloc.free_window(slots[:12])
    return alloc, tree, seq, slots, WindowPolicy(tree, W, host=host)


def check(tree, windows, held=None):
    tree.check_integrity(held_slots=held)
    windows.check_integrity(held)


@pytest.mark.parametrize("prefix,want", [(24, 24), (23, 20), (20, 20), (19, 0), (16, 0), (8, 0)])
def test_match_ends_where_the_window_before_it_is_held(prefix, want):
    """A prefix ending at L needs the window parts of tokens L - W .. L - 1: the tombstones
    before them are crossed, one inside them cuts the match back (here to nothing: every
    earlier end has a tombstone within W before it)."""
    alloc, tree, seq, slots, windows = cached()
    m = windows.fit(tree.match(seq[:prefix] + [7, 7, 7, 7]))
    assert m.device_slots.tolist() == slots[:want].tolist() and m.host_hit_tokens == 0
    assert sum(len(n.key) for n in _path(m.last_node)) == want
    check(tree, windows)


def test_whole_window_from_the_start_matches_short_prefixes():
    alloc, tree, seq, slots, windows = cached()
    alloc.free_window(slots[12:16])  # the window of prefixes ending at 16..20 is now broken
    assert windows.fit(tree.match(seq)).device_slots.numel() == 24
    assert windows.fit(tree.match(seq[:20])).device_slots.numel() == 0
    check(tree, windows)


def test_integrity_counts_window_parts():
    alloc, tree, seq, slots, windows = cached()
    held = alloc.alloc(8)  # a running request's slots
    check(tree, windows, held)
    lost = alloc.windows.alloc(PS)  # window slots taken past the map
    with pytest.raises(AssertionError, match="window: .* leak"):
        check(tree, windows, held)
    alloc.windows.free(lost)
    alloc.window_map[alloc.free_slots()[:PS]] = alloc.window_map[held[:PS]]
    with pytest.raises(AssertionError, match="free slot holds a window part"):
        check(tree, windows, held)


def test_integrity_wants_an_l2_copy_under_every_tombstone():
    alloc, tree, seq, slots, windows = cached(host=True)
    with pytest.raises(AssertionError, match="tombstone on L1 without an L2 copy"):
        check(tree, windows)
    for node in tree.nodes():
        tree.attach_host(node, tree.host_allocator.alloc(len(node.key)))
    check(tree, windows)


def test_allocator_gives_both_parts_back():
    alloc = WindowedAllocator(4, 2, PS, W)
    a = alloc.alloc(8)
    assert alloc.num_free_tokens() == 0 and alloc.alloc(4) is None  # the window pool is the short one
    alloc.free_window(a[:4])
    b = alloc.alloc(4)
    assert torch.equal(alloc.window_present(torch.cat([a, b])), torch.tensor([False] * 4 + [True] * 8))
    alloc.free(torch.cat([a, b]))
    assert alloc.num_free_tokens() == 8 and alloc.num_free_window_tokens() == 8


def _path(node):
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


@pytest.mark.parametrize("dropped,tail,repair", [(20, 4, 0), (24, 4, 4), (24, 8, 0)])
def test_with_l2_a_missing_window_is_repaired_not_cut(dropped, tail, repair):
    """An L1 part with tombstones (each with its L2 copy), then `tail` tokens only L2 holds: the
    match keeps both and names the L1 tokens of the window before its end whose window parts a
    load-back restores (`repair`; none when L1 holds them or the L2 part covers the window).
    Without the load, the request resumes after `device_prefix`, cut where the window before
    the L1 part's end is missing."""
    alloc, tree, seq, slots, windows = cached(host=True)
    host = tree.host_allocator
    for node in list(tree.nodes()):
        tree.attach_host(node, host.alloc(len(node.key)))
    alloc.free_window(slots[:dropped])
    ext = seq + list(range(200, 200 + tail))
    assert tree.insert_host(ext, host.alloc(tail), 24) == 0
    m = windows.fit(tree.match(ext))
    assert (m.device_slots.numel(), m.host_hit_tokens, m.repair) == (24, tail, repair)
    alone = windows.device_prefix(m)
    assert (alone.host_hit_tokens, alone.repair) == (0, 0)
    assert alone.device_slots.numel() == (24 if dropped <= 16 else 0)
    branch = windows.fit(tree.match(seq[:16] + [7] * 4))  # ends inside the tombstones: all of its window comes back
    assert (branch.device_slots.numel(), branch.host_hit_tokens, branch.repair) == (16, 0, 8)
    check(tree, windows)
