"""`CacheManager` (hicache/manager.py), the scheduler's door to the cache, on fake tiers: admission
with an L1 prefix and an L2 part loaded back, growth, release, a failed load reported through
`poll`, refusals that leave nothing held, and integrity after each step.

KV is modelled as in test_controller.py: the value of token i of a sequence is the tuple of the
sequence up to i, written by "computing" a request's own slots.
"""
from __future__ import annotations

from hicache.manager import CacheManager, Lease
from hicache.tree import RadixTree
import cache_fakes as fakes


class Setup:
    def __init__(self, ps=2, device_pages=16, host_pages=64, rows=4, deferred=False):
        self.ps, self.rows = ps, rows
        self.alloc = fakes.FakeAllocator(device_pages, ps)
        self.host_pool = fakes.FakeHostPool(host_pages, ps)
        self.dev, self.host = {}, {}
        self.xfer = fakes.FakeTransfer(self.dev, self.host, deferred)
        tree = RadixTree(self.alloc, ps, "lru", host_allocator=self.host_pool.allocator)
        self.table = fakes.FakeTable(rows)
        self.cache = CacheManager.build(tree, self.table, self.host_pool, self.xfer, load_back_min_tokens=1)
        self.leases: list[Lease] = []

    def admit(self, tokens, first_chunk):
        """Admits `tokens` (all but the last are cached candidates) and grows for its first chunk."""
        lease = Lease("", owner=tokens)
        got = self.cache.admit(lease, self.cache.match(tokens[:-1], ""), first_chunk)
        if got is None:
            return lease, None
        assert self.cache.grow(lease, got.prefix + first_chunk)
        self.leases.append(lease)
        self.check()
        return lease, got

    def compute(self, lease, tokens, upto):
        for i in range(lease.prefix_len, upto):
            self.dev[int(lease.slots[i])] = tuple(tokens[:i + 1])

    def release(self, lease, tokens, keep=True):
        self.cache.release(lease, tokens, len(tokens), keep)
        self.leases.remove(lease)
        self.check()

    def assert_kv(self, tokens, lease, upto):
        got = [self.dev.get(int(s)) for s in lease.slots[:upto]]
        assert got == [tuple(tokens[:i + 1]) for i in range(upto)], "a cached page holds the wrong KV"

    def check(self):
        self.cache.check_integrity(self.leases, self.rows)
        for lease in self.leases:  # the table row lists the lease's slots in order
            assert [self.table.rows[lease.row][i] for i in range(lease.slots.numel())] == lease.slots.tolist()


def test_second_request_reuses_the_first_ones_prefix_from_l1():
    s = Setup()
    a = list(range(10))
    lease, got = s.admit(a, 10)
    assert got.prefix == 0 and lease.held
    s.compute(lease, a, 10)
    s.release(lease, a)
    b = a + [42, 43]
    lease, got = s.admit(b, 2)
    assert (got.prefix, got.loaded) == (10, 0) and lease.prefix_len == 10
    s.assert_kv(b, lease, 10)
    s.compute(lease, b, 12)
    s.release(lease, b)
    assert s.table.num_free() == s.rows and not lease.held


def test_l2_part_is_loaded_back_and_waited_for_through_the_handle():
    s = Setup(deferred=True)
    a = list(range(12))
    lease, _ = s.admit(a, 12)
    s.compute(lease, a, 12)
    s.release(lease, a)
    s.xfer.complete()  # the write-through backup lands
    s.cache.poll([])
    s.cache.host.evict_device(10**9)  # L1 forgets it; L2 keeps it
    assert s.cache.match(a, "").host_tokens == 12
    b = a + [7, 8]
    lease, got = s.admit(b, 2)
    assert got.loaded == 12 and lease.loading
    handle = s.cache.start_loads([lease])
    assert handle is not None and s.cache.start_loads([Lease()]) is None
    handle.wait_layer(0)  # the fake engine has no per-layer waits: it completes the copy
    handle.settle()
    s.cache.poll([lease])
    s.cache.refresh(lease)
    assert not lease.loading
    s.assert_kv(b, lease, 12)
    s.release(lease, b)


def test_failed_load_is_reported_once_and_the_prefix_is_recomputed():
    s = Setup(deferred=True)
    a = list(range(12))
    lease, _ = s.admit(a, 12)
    s.compute(lease, a, 12)
    s.release(lease, a)
    s.xfer.complete()
    s.cache.poll([])
    s.cache.host.evict_device(10**9)
    s.xfer.fail_next("load")
    lease, got = s.admit(a + [1], 1)
    assert got.loaded == 12 and lease.loading
    s.xfer.complete()
    assert s.cache.poll([lease]) == [lease]
    s.release(lease, a + [1], keep=False)  # nothing of it cached; the stale L1 copy is dropped
    assert s.cache.poll([]) == []
    m = s.cache.match(a, "")
    assert (m.device_tokens, m.host_tokens) == (0, 12)  # host-only again, L2 intact
    lease, got = s.admit(a + [1], 1)
    s.xfer.complete()
    s.cache.poll([lease])
    s.assert_kv(a, lease, 12)
    s.release(lease, a + [1])


def test_refusals_leave_nothing_held():
    s = Setup(device_pages=4, rows=1)
    a = list(range(6))
    first, _ = s.admit(a, 6)
    second, got = s.admit(list(range(100, 106)), 6)  # no table row left
    assert got is None and not second.held
    s.check()
    assert not s.cache.grow(first, 6 + 2 * s.ps * 4)  # more than L1 holds, nothing evictable
    assert first.slots.numel() == 6
    s.compute(first, a, 6)
    s.release(first, a)
    assert s.table.num_free() == 1


def test_grow_all_grows_as_one_grow_after_another():
    grown, taken = [], []
    for together in (False, True):
        s = Setup(ps=2, device_pages=16, rows=3)
        leases = [s.admit(list(range(k * 10, k * 10 + 3)), 3)[0] for k in range(3)]
        uptos = [5, 3, 8]  # the second needs nothing
        assert s.cache.grow_all(leases, uptos) if together else all(map(s.cache.grow, leases, uptos))
        s.check()
        grown.append([lease.slots.numel() for lease in leases])
        taken.append(sorted(sum((lease.slots.tolist() for lease in leases), [])))
        assert not s.cache.grow_all(leases, [40, 3, 3])  # more than L1 holds: refused, nothing taken
        assert [lease.slots.numel() for lease in leases] == grown[-1]
    assert grown[0] == grown[1] == [6, 4, 8] and taken[0] == taken[1]


def test_flush_waits_for_the_backups_of_finished_requests():
    """A request just finished: its write-through backup is still in flight. A flush (what
    SGLang's bench_serving sends right after its warm-up request) lets it land, then empties both
    tiers, instead of refusing."""
    s = Setup(deferred=True)
    a = list(range(12))
    lease, _ = s.admit(a, 12)
    s.compute(lease, a, 12)
    s.release(lease, a)
    assert s.cache.busy()  # the backup is queued, not landed
    assert s.cache.flush() is True
    assert s.cache.match(a, "").tokens == 0 and s.alloc.num_free_tokens() == 32
    assert s.host_pool.allocator.num_free_tokens() == 128
    s.check()
