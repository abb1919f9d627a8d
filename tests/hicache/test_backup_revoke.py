"""L3 backups never hold L2 hostage: backups still queued give up their pins when L2 needs room
(the controller on fake tiers and a fake L3 whose backups never finish on their own), while a
backup that has started keeps its pages."""
from __future__ import annotations

from hicache.config import StorageOptions
from hicache.manager import CacheManager, StorageSetup
from hicache.tree import RadixTree
import cache_fakes as fakes

PS = 2


def setup(host_pages: int):
    alloc = fakes.FakeAllocator(64, PS)
    host_pool = fakes.FakeHostPool(host_pages, PS)
    tree = RadixTree(alloc, PS, "lru", host_allocator=host_pool.allocator)
    storage = fakes.FakeStorage()
    cache = CacheManager.build(tree, fakes.FakeTable(1), host_pool, fakes.FakeTransfer({}, {}), load_back_min_tokens=1,
                               storage=StorageSetup(storage, b"seed" * 8, StorageOptions(), "fake"))
    return cache, alloc, storage


def insert(cache, alloc, tokens):
    cache.host.insert(tokens, alloc.alloc(len(tokens)))
    cache.poll([])  # the L1 -> L2 copy lands and its L3 backup is queued


def test_queued_backups_are_revoked_so_that_l2_can_evict_and_a_started_one_keeps_its_pages():
    cache, alloc, storage = setup(host_pages=4)
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    insert(cache, alloc, first)
    insert(cache, alloc, second)
    backups = sorted(t for t, (kind, _) in storage.queued.items() if kind == "backup")
    assert len(backups) == 2 and cache.tree.host_tokens() == 8
    storage.start(backups[0])  # the first one is being written: its pages stay pinned
    cache.host.evict_device(10**9)  # both host-only now, and L2 is full
    insert(cache, alloc, [9, 10, 11, 12])  # needs L2 room: only the queued backup can give it
    assert storage.revoked == [backups[1]]
    stats = cache.storage.stats()
    assert stats["backup_revoked_tokens"] == len(second)
    assert cache.tree.match(first).host_hit_tokens == len(first)  # pinned by the running backup
    assert cache.tree.match(second).host_hit_tokens == 0  # evicted once its backup was withdrawn
    cache.check_integrity([], 1)
    storage.complete()
    cache.poll([])
    assert not cache.storage.busy() and not any(n.host_pin for n in cache.tree.nodes())
    cache.check_integrity([], 1)


def test_without_room_even_after_revoking_the_backup_is_skipped():
    cache, alloc, storage = setup(host_pages=2)
    insert(cache, alloc, [1, 2, 3, 4])
    (ticket,) = storage.queued
    storage.start(ticket)
    cache.host.insert([5, 6, 7, 8], alloc.alloc(4))  # L1 holds it; L2 has no room: the backup is skipped
    assert cache.host.counters["backup_skipped_tokens"] == 4 and storage.revoked == []
    assert cache.tree.match([5, 6, 7, 8]).device_slots.numel() == 4 and cache.tree.host_tokens() == 4
    cache.check_integrity([], 1)
