"""The cache brain (hicache/controller.py) on fake tiers: match with an L2 continuation, load-back,
write policies, the eviction cascade, failed and in-flight transfers, flush, stats, integrity.

KV is modelled as values in two dicts (device slot -> value, host slot -> value); the value of
token i of a sequence is the tuple of the sequence up to i, so a wrong page is visible.
"""
from __future__ import annotations

import random

import pytest
import torch

from hicache.controller import CacheController
from hicache.tree import RadixTree
import cache_fakes as fakes




class Harness:
    """The scheduler's side of the protocol, one request at a time (or held open)."""

    def __init__(self, ps=1, device_pages=16, host_pages=64, policy="write_through", deferred=False, min_load=1):
        self.ps = ps
        self.alloc = fakes.FakeAllocator(device_pages, ps)
        self.host_pool = fakes.FakeHostPool(host_pages, ps)
        self.dev_mem, self.host_mem = {}, {}
        self.xfer = fakes.FakeTransfer(self.dev_mem, self.host_mem, deferred)
        self.tree = RadixTree(self.alloc, ps, "lru", host_allocator=self.host_pool.allocator)
        self.ctrl = CacheController(self.tree, self.host_pool, self.xfer, policy, load_back_min_tokens=min_load)
        self.open: dict[str, dict] = {}

    def start(self, rid, tokens, ns="", extra=0):
        """Admission: match, lock, load back, allocate and 'compute' the rest."""
        m = self.tree.match(tokens, ns)
        self.tree.lock(m.last_node)
        last, slots, host = m.last_node, m.device_slots, 0
        lb = self.ctrl.load_back(m, extra)
        if not lb.refused:
            last, slots, host = lb.last_node, torch.cat([slots, lb.device_slots]), lb.device_slots.numel()
        prefix = slots.numel()
        need = -(-(len(tokens) - prefix) // self.ps) * self.ps
        if need > self.alloc.num_free_tokens():
            self.ctrl.evict_device(need - self.alloc.num_free_tokens())
        fresh = self.alloc.alloc(need)
        if fresh is None:  # no room: give up, holding nothing (what was loaded stays cached)
            self.tree.unlock(last)
            self.check()
            return None
        for i, s in enumerate(fresh[: len(tokens) - prefix].tolist()):
            self.dev_mem[s] = tuple(tokens[: prefix + i + 1])
        self.open[rid] = dict(tokens=tokens, ns=ns, last=last, prefix=prefix, slots=torch.cat([slots, fresh]),
                              host=host, waits=self.ctrl.pending_loads(last), match=m)
        self.check()
        return self.open[rid]

    def finish(self, rid, keep=True):
        r = self.open.pop(rid)
        tokens, slots, prefix = r["tokens"], r["slots"], r["prefix"]
        kv = len(tokens) if keep else prefix
        present = self.ctrl.insert(tokens[:kv], slots[:kv], r["ns"], kv) if kv else 0
        aligned = kv // self.ps * self.ps
        self.alloc.free(slots[prefix:max(present, prefix)])
        self.alloc.free(slots[max(aligned, prefix):])
        self.tree.unlock(r["last"])
        self.check()
        return r

    def run(self, tokens, ns="", extra=0):
        r = self.start("one", tokens, ns, extra)
        self.assert_kv(tokens, r["slots"][: r["prefix"]])
        return self.finish("one")

    def assert_kv(self, tokens, slots):
        got = [self.dev_mem.get(s) for s in slots.tolist()]
        want = [tuple(tokens[: i + 1]) for i in range(len(got))]
        assert got == want, "a cached page holds the wrong KV"

    def check(self):
        held = [r["slots"][r["prefix"]:] for r in self.open.values()]
        locks = {}
        for r in self.open.values():
            locks[r["last"]] = locks.get(r["last"], 0) + 1
        self.ctrl.check_integrity(torch.cat(held) if held else None, locks)

    def flush(self) -> bool:
        """Empties L1 and L2 as `CacheManager.flush` does (no L3 here); False while transfers run."""
        if not self.ctrl.idle():
            return False
        self.ctrl.reset()
        return True

    def evict_all_device(self):
        self.ctrl.evict_device(10**9)
        self.check()


def seq(n, start=0):
    return list(range(start, start + n))


def test_match_returns_device_part_then_host_continuation():
    h = Harness(ps=2)
    a = seq(12)
    h.run(a)
    assert h.tree.host_tokens() == 12 and h.xfer.submitted == [("backup", 12)]  # write-through on insert
    h.run(a[:6] + seq(4, 100))  # splits the node at 6; the new branch is on both tiers too
    h.ctrl.evict_device(6)  # LRU: the branch [100..] goes first, then the 6 tokens of a's tail
    m = h.tree.match(a + [99])
    assert m.device_slots.numel() == 6 and m.host_hit_tokens == 6
    assert m.last_node is not m.last_host_node and m.last_host_node.device_slots is None
    assert len(m.last_node.key) + len(m.last_host_node.key) == 12
    h.check()


def test_load_back_fills_fresh_slots_with_the_right_kv_and_moves_the_lock():
    h = Harness(ps=2)
    a = seq(10)
    h.run(a)
    h.evict_all_device()
    assert h.tree.total_tokens() == 0 and h.tree.host_tokens() == 10
    r = h.start("r", a + [50, 51])
    assert r["prefix"] == 10 and r["host"] == 10 and r["last"].device_slots is not None
    assert r["last"].lock_ref == 1 and r["last"].host_slots is not None  # now on both tiers
    h.assert_kv(a, r["slots"][:10])
    h.finish("r")
    s = h.ctrl.host_stats()
    assert s["loaded_back_tokens"] == 10 and s["loaded_back_bytes"] == 1000 and s["enabled"]
    # busy and queued time apart, summed per transfer: one load-back; backups of a, then of r's tail
    assert (s["load_backs"], s["load_back_seconds"], s["load_back_wait_seconds"]) == (1, 0.001, 0.002)
    assert (s["backups"], s["backup_seconds"], s["backup_wait_seconds"]) == (2, 0.002, 0.004)


def test_load_back_is_all_or_nothing_with_a_minimum_and_room():
    h = Harness(ps=1, device_pages=12, min_load=5)
    h.run(seq(8))
    h.evict_all_device()
    m = h.tree.match(seq(3) + [99])
    assert m.host_hit_tokens == 3 and h.ctrl.load_back(m).refused == "short"  # under the minimum: recompute
    m = h.tree.match(seq(8))
    assert h.ctrl.load_back(m, extra_tokens=5).refused == "room"  # 8 + 5 > 12 slots: nothing moves
    assert h.tree.total_tokens() == 0 and h.alloc.num_free_tokens() == 12
    assert h.ctrl.host_stats()["load_back_deferred"] == 1
    h.check()
    # Recomputing a host-only prefix gives those nodes their device copy back (no duplicate).
    r = h.run(seq(3) + [99])
    assert r["prefix"] == 0 and h.tree.total_tokens() == 4
    h.assert_kv(seq(3), h.tree.match(seq(3) + [7]).device_slots)


def test_write_through_selective_backs_up_prompts_at_finish_and_generated_pages_on_reuse():
    h = Harness(policy="write_through_selective")
    a = seq(10)
    r = h.start("r", a)
    h.ctrl.insert(a, r["slots"], "", prompt_tokens=6)  # as a finish: prompt 6, 4 generated
    h.alloc.free(r["slots"][:0])
    h.tree.unlock(r["last"])
    h.open.pop("r")
    h.check()
    assert h.tree.host_tokens() == 6  # the prompt part only
    h.run(a + [77])  # a second request reuses the generated part: now it is worth keeping
    assert h.tree.host_tokens() == 11  # (and that request's own prompt token, at its finish)


def test_write_back_copies_down_only_when_evicted():
    h = Harness(policy="write_back")
    a = seq(10)
    h.run(a)
    assert h.tree.host_tokens() == 0 and not h.xfer.submitted
    h.evict_all_device()
    assert h.tree.host_tokens() == 10 and h.xfer.submitted == [("backup", 10)]
    r = h.run(a + [1])
    assert r["host"] == 10


def test_device_eviction_deletes_what_l2_lacks():
    h = Harness(policy="write_through_selective")
    h.run(seq(5, 200))  # a finished prompt: backed up
    h.ctrl.insert(seq(4, 300), h.alloc.alloc(4), "")  # generated only: not backed up
    h.check()
    h.evict_all_device()
    assert h.tree.match(seq(4, 300)).host_hit_tokens == 0  # deleted
    assert h.tree.match(seq(5, 200)).host_hit_tokens == 5  # kept, host-only
    assert h.ctrl.counters["device_evicted_tokens"] == 9


def test_host_eviction_takes_unpinned_host_only_leaves_lru_first():
    h = Harness(ps=1, device_pages=8, host_pages=12)
    h.run(seq(6, 0))
    h.run(seq(6, 100))  # L2 holds both; L1 holds 8: the first was partly evicted
    h.evict_all_device()
    h.run(seq(6, 200))  # needs 6 host slots: the LRU host-only leaf (seq 0) goes
    assert h.tree.match(seq(6, 0)).host_hit_tokens == 0
    assert h.tree.match(seq(6, 100)).host_hit_tokens == 6
    assert h.ctrl.host_stats()["evicted_tokens"] == 6


def test_a_full_l2_gives_up_copies_l1_holds_before_pages_only_it_holds():
    h = Harness(ps=1, device_pages=12, host_pages=12)
    h.run(seq(6, 0))
    h.evict_all_device()  # seq 0: host-only
    h.run(seq(6, 100))  # on both tiers; L2 has 0 free
    h.run(seq(6, 200))  # its backup needs 6 L2 slots: seq 100's copy goes, its L1 pages stay
    held = {n.key: n for n in h.tree.nodes()}  # (no match: it would refresh what it finds)
    assert held[tuple(seq(6, 0))].host_slots is not None  # what only L2 held survives
    s = h.ctrl.host_stats()
    assert s["reclaimed_tokens"] == 6 and s["evicted_tokens"] == 0
    reclaimed = [n for n in h.tree.nodes() if n.host_reclaimed]
    assert reclaimed and all(n.device_slots is not None and n.host_slots is None for n in reclaimed)
    h.evict_all_device()  # L1 copies the reclaimed pages down (L2 frees room for them) before dropping them
    h.check()
    held = {n.key: n for n in h.tree.nodes()}
    assert held[tuple(seq(6, 100))].host_slots is not None, "a reclaimed page was lost on L1 eviction"
    r = h.start("r", seq(6, 100) + [7])
    h.assert_kv(seq(6, 100), r["slots"][:6])  # loaded back with the right KV
    h.finish("r")


def test_host_exhaustion_leaves_pages_device_only_and_nothing_leaks():
    h = Harness(ps=2, device_pages=16, host_pages=3)  # L2 holds 6 tokens
    h.run(seq(4))
    h.start("r", seq(8, 50))  # locked, so its path cannot be evicted anywhere
    h.run(seq(10, 300))  # 10 tokens > 6: no backup, the request is unaffected
    assert h.ctrl.counters["backup_skipped_tokens"] == 10
    h.finish("r")
    h.evict_all_device()  # the unbacked nodes are deleted, the backed one stays on L2
    h.check()
    assert h.tree.total_tokens() == 0 and h.alloc.num_free_tokens() == 32


def test_failed_backup_keeps_the_node_on_device_only():
    h = Harness()
    h.xfer.fail_next("backup")
    h.run(seq(6))
    assert h.tree.host_tokens() == 0 and h.host_pool.allocator.num_free_tokens() == 64
    assert h.ctrl.host_stats()["transfer_failures"] == 1
    h.run(seq(6) + [9])  # the next insert backs it up
    assert h.tree.host_tokens() == 7


def test_failed_load_at_once_is_undone_and_the_request_recomputes():
    h = Harness(ps=2)
    a = seq(8)
    h.run(a)
    h.evict_all_device()
    h.xfer.fail_next("load")
    r = h.start("r", a + [1, 2])
    assert r["host"] == 0 and r["prefix"] == 0  # recomputed from scratch
    h.finish("r")
    h.assert_kv(a, h.tree.match(a).device_slots)  # the recomputed KV, never the failed copy
    assert h.ctrl.host_stats()["transfer_failures"] == 1


def test_failed_load_in_flight_marks_nodes_stale_until_waiters_are_gone():
    h = Harness(ps=1, deferred=True)
    a = seq(8)
    h.run(a)
    h.xfer.complete()
    h.ctrl.poll()
    h.evict_all_device()
    h.xfer.fail_next("load")
    r = h.start("r", a + [1])
    assert r["host"] == 8 and r["waits"]
    other = h.start("o", a[:4] + [5, 6])  # matches part of the loading chain: waits too
    assert other["waits"] == r["waits"] and other["prefix"] == 4
    h.xfer.complete()
    failed = h.ctrl.poll()
    assert failed == r["waits"]
    assert h.tree.match(a).device_slots.numel() == 0  # stale nodes are never served
    h.finish("r", keep=False)
    h.finish("o", keep=False)
    h.ctrl.drop_stale()
    h.check()
    m = h.tree.match(a)
    assert m.device_slots.numel() == 0 and m.host_hit_tokens == 8  # host-only again, L2 intact
    r = h.start("r2", a + [1])
    h.xfer.complete()
    assert not h.ctrl.poll()
    h.assert_kv(a, r["slots"][:8])
    h.finish("r2")


def test_abort_during_load_back_releases_everything_once_the_copy_lands():
    h = Harness(ps=2, deferred=True)
    a = seq(8)
    h.run(a)
    h.xfer.complete()
    h.ctrl.poll()
    h.evict_all_device()
    r = h.start("r", a + [1, 2])
    assert r["host"] == 8
    h.finish("r", keep=False)  # aborted before the copy finished
    assert h.flush() is False  # the transfer still pins its pages
    h.ctrl.evict_device(100)
    h.ctrl.tree.evict_host(100)
    assert h.tree.host_tokens() == 8  # pinned and locked: neither tier may take them
    h.xfer.complete()
    assert not h.ctrl.poll()
    h.check()
    assert h.flush() is True
    h.check()
    assert h.alloc.num_free_tokens() == 32 and h.host_pool.allocator.num_free_tokens() == 128


def test_split_during_an_in_flight_backup_keeps_pins_balanced():
    h = Harness(ps=1, deferred=True)
    a = seq(10)
    h.run(a)  # backup queued
    h.run(a[:4] + [77])  # splits the node being written
    h.check()
    assert sorted(len(n.key) for n in h.ctrl.transfers.expected_pins()) == [1, 4, 6]  # + the new leaf's backup
    h.xfer.complete()
    h.ctrl.poll()
    h.check()
    assert all(n.host_pin == 0 for n in h.tree.nodes())


def test_write_back_under_eviction_waits_for_the_copy():
    h = Harness(ps=1, device_pages=10, policy="write_back", deferred=True)
    a = seq(8)
    h.run(a)
    h.run(seq(6, 100))  # needs room: `a` is copied down (synchronized) before its pages go
    h.check()
    assert h.tree.match(a).host_hit_tokens > 0
    r = h.start("r", a + [3])
    h.xfer.complete()
    h.ctrl.poll()
    h.assert_kv(a, r["slots"][:8])
    h.finish("r")


def test_device_only_parent_of_host_only_children_is_copied_down_or_dropped_with_them():
    h = Harness(ps=1, policy="write_back")
    h.run(seq(8))
    h.evict_all_device()
    r = h.run(seq(4) + [50, 51])  # recomputes... no: loads seq(4), adds a device-only branch
    assert r["host"] == 4
    h.evict_all_device()
    h.check()
    assert h.tree.match(seq(8)).host_hit_tokens == 8 and h.tree.match(seq(4) + [50, 51]).host_hit_tokens == 6


def test_flush_clears_both_tiers_and_stats_count_moves():
    h = Harness(ps=2)
    for i in range(4):
        h.run(seq(8, 100 * i))
    h.evict_all_device()
    h.run(seq(8, 100) + [5])
    s = h.ctrl.host_stats()
    assert s["backed_up_tokens"] == 32 + 0 and s["loaded_back_tokens"] == 8
    assert s["used_tokens"] == h.tree.host_tokens() and s["capacity_tokens"] == 128
    assert h.flush()
    h.check()
    assert h.tree.total_tokens() == h.tree.host_tokens() == 0
    assert h.alloc.num_free_tokens() == 32 and h.host_pool.allocator.num_free_tokens() == 128


def test_disabled_l2_is_a_thin_layer_over_the_tree():
    alloc = fakes.FakeAllocator(16, 1)
    ctrl = CacheController(RadixTree(alloc, 1))
    slots = alloc.alloc(4)
    assert ctrl.insert(seq(4), slots) == 0
    assert ctrl.load_back(ctrl.tree.match(seq(4))).refused == "short"
    assert ctrl.host_stats()["enabled"] is False
    assert ctrl.evict_device(4) == 4 and ctrl.idle()
    with pytest.raises(ValueError):
        CacheController(RadixTree(alloc, 1), fakes.FakeHostPool(4, 1), None)


def poll_and_recover(h):
    """The scheduler's reaction to failed loads: recompute their waiters, caching nothing new."""
    failed = h.ctrl.poll()
    for rid in [r for r, v in h.open.items() if v["waits"] & failed]:
        h.finish(rid, keep=False)
    h.ctrl.drop_stale()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("deferred", [False, True])
def test_random_flows_keep_every_invariant(policy, deferred):
    """Random requests held open in parallel, evictions of both tiers, aborts, failures, flushes."""
    rng = random.Random(f"{policy}-{deferred}")
    h = Harness(ps=2, device_pages=40, host_pages=60, policy=policy, deferred=deferred, min_load=2)
    stems = [seq(12, 1000 * k) for k in range(5)]
    for step in range(400):
        op = rng.random()
        if op < 0.45 and len(h.open) < 3:
            tokens = rng.choice(stems)[: rng.randrange(2, 13)] + [rng.randrange(5) for _ in range(rng.randrange(0, 5))]
            h.start(f"r{step}", tokens, rng.choice(["", "", "t"]), extra=rng.randrange(0, 4))
        elif op < 0.75 and h.open:
            poll_and_recover(h)
            rid = rng.choice(sorted(h.open) or [None])
            if rid is not None:
                h.finish(rid, keep=h.ctrl.loads_done(h.open[rid]["waits"]) and rng.random() < 0.8)
        elif op < 0.82:
            h.ctrl.evict_device(rng.randrange(1, 30))
        elif op < 0.88:
            h.ctrl.evict_host(rng.randrange(1, 30))
        elif op < 0.91:
            h.xfer.fail_next(rng.choice(["backup", "load"]))
        elif op < 0.97:
            h.xfer.complete()
            poll_and_recover(h)
        elif not h.open:
            h.xfer.complete()
            h.ctrl.poll()
            assert h.flush()
        h.check()
        for r in h.open.values():  # whatever a request was told is cached holds the right KV
            if h.ctrl.loads_done(r["waits"]):
                h.assert_kv(r["tokens"], r["slots"][: r["prefix"]])
    h.xfer.complete()
    for rid in list(h.open):
        h.finish(rid, keep=False)
    h.ctrl.poll()
    h.ctrl.drop_stale()
    assert h.flush()
    h.check()
    c = h.ctrl.counters
    assert all(c[k] for k in ("loaded_back_tokens", "transfer_failures", "device_evicted_tokens", "host_evicted_tokens")), dict(c)
