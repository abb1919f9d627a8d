"""Load or recompute, decided from rates measured while serving (`hicache/decide.py`), on fake
tiers: a slow L3 or L2 (as its transfers report) makes requests recompute, a fast one makes them
load; `always` loads whatever the rates; a tier that keeps losing is probed now and then."""
from __future__ import annotations

import pytest

from hicache.decide import PROBE_EVERY, LoadDecider
from hicache.config import StorageOptions
from hicache.manager import CacheManager, Lease, StorageSetup
from hicache.tree import RadixTree
import cache_fakes as fakes

PS = 4
BYTES_PER_TOKEN = 100  # FakeHostPool's
PREFILL = 1000.0  # tokens per second: recomputing a page takes 4 ms


def test_decider_weighs_load_time_queue_included_against_recompute_time():
    d = LoadDecider("measured_all", BYTES_PER_TOKEN)
    assert d.load("storage", 64)  # nothing measured yet: load
    d.record_prefill(1000, 1.0)
    d.record_load("storage", 10_000, 1.0)  # 100 tokens/s worth of bytes: 10x slower than prefill
    assert not d.load("storage", 64)
    d.record_load("host", 10**9, 1.0)
    assert d.load("host", 64) and not d.load("host", 64, queued_bytes=10**9)  # a queue ahead of it
    assert d.stats("storage")["recomputed_by_choice_tokens"] == 64
    assert d.stats("host")["recomputed_by_choice_tokens"] == 64
    assert all(LoadDecider("always", BYTES_PER_TOKEN).load("storage", 64) for _ in range(3))
    default = LoadDecider("measured", BYTES_PER_TOKEN)
    default.record_prefill(1000, 1.0)
    default.record_load("host", 1, 1.0)
    assert default.load("host", 64)  # L2 hits are decided under measured_all only
    refusals = [d.load("storage", 8) for _ in range(PROBE_EVERY)]
    assert refusals.count(True) == 1 and d.stats("storage")["load_probes"] == 1  # a probe keeps it measured
    with pytest.raises(ValueError):
        LoadDecider("sometimes")


def test_a_prefill_backlog_counts_against_recomputing():
    d = LoadDecider("measured", BYTES_PER_TOKEN)
    d.record_prefill(1000, 1.0)
    d.record_load("storage", 50_000, 1.0)  # 500 tokens/s worth of bytes: half the prefill rate
    assert not d.load("storage", 64)
    d.set_backlog(64)  # 64 tokens ahead: recomputing takes as long as loading
    assert d.load("storage", 64)
    d.set_backlog(0)
    assert not d.load("storage", 64)


def storage_setup(seconds_per_page: float, mode: str = "measured"):
    alloc = fakes.FakeAllocator(64, PS)
    host_pool = fakes.FakeHostPool(64, PS)
    tree = RadixTree(alloc, PS, host_allocator=host_pool.allocator)
    engine = fakes.FakeStorage(hits=8, page_bytes=PS * BYTES_PER_TOKEN, seconds_per_page=seconds_per_page)
    cache = CacheManager.build(tree, fakes.FakeTable(2), host_pool, fakes.FakeTransfer({}, {}), load_back_min_tokens=1,
                               load_decision=mode,
                               storage=StorageSetup(engine, b"seed" * 8, StorageOptions(prefetch_threshold=PS), "fake"))
    return cache, engine


def prefetch(cache, engine, start: int) -> int:
    """A request whose 8 pages L3 holds arrives; returns the prompt tokens L3 served it."""
    tokens = list(range(start, start + 8 * PS + 1))
    lease = Lease("", owner=tokens)
    cache.prefetch(lease, tokens)
    for _ in range(2):  # the query's answer, then the fetch's (if one started)
        engine.complete()
        cache.poll([])
    got = cache.prefetch_ready(lease)
    return got.end - got.start


@pytest.mark.parametrize("seconds_per_page, loads", [(0.1, False), (0.0001, True)], ids=["slow", "fast"])
def test_a_slow_l3_is_recomputed_and_a_fast_one_loaded(seconds_per_page, loads):
    cache, engine = storage_setup(seconds_per_page)
    assert prefetch(cache, engine, 0) == 8 * PS  # not measured yet: loaded, and measured
    cache.record_prefill(1000, 1000 / PREFILL)
    served = prefetch(cache, engine, 10_000)
    stats = cache.storage.stats()
    assert served == (8 * PS if loads else 0)
    assert stats["prefetch_recompute_chosen"] == (0 if loads else 1)
    assert stats["recomputed_by_choice_tokens"] == (0 if loads else 8 * PS)
    assert stats["measured_load_bytes_per_s"] > 0 and stats["measured_prefill_tokens_per_s"] == PREFILL
    slow_always, engine = storage_setup(seconds_per_page, "always")
    prefetch(slow_always, engine, 0)
    slow_always.record_prefill(1000, 1000 / PREFILL)
    assert prefetch(slow_always, engine, 10_000) == 8 * PS


@pytest.mark.parametrize("seconds, loads", [(10.0, False), (0.0001, True)], ids=["slow", "fast"])
def test_a_slow_l2_is_recomputed_and_a_fast_one_loaded(seconds, loads):
    alloc = fakes.FakeAllocator(32, PS)
    host_pool = fakes.FakeHostPool(64, PS)
    tree = RadixTree(alloc, PS, host_allocator=host_pool.allocator)
    cache = CacheManager.build(tree, fakes.FakeTable(2), host_pool, fakes.FakeTransfer({}, {}), load_back_min_tokens=1,
                               load_decision="measured_all")
    ctrl = cache.host
    cache.record_prefill(1000, 1000 / PREFILL)
    ctrl.decider.record_load("host", 16 * BYTES_PER_TOKEN, seconds)  # what earlier loads measured
    tokens = list(range(17))
    lease = Lease("", owner=tokens)
    cache.admit(lease, cache.match(tokens[:-1], ""), PS)
    cache.grow(lease, 17)
    cache.release(lease, tokens, 17)
    cache.poll([])
    ctrl.evict_device(10**9)  # host-only now
    lease = Lease("", owner=tokens)
    got = cache.admit(lease, cache.match(tokens[:-1], ""), PS)
    assert got.loaded == (16 if loads else 0) and got.prefix == got.loaded
    assert ctrl.host_stats()["recomputed_by_choice_tokens"] == (0 if loads else 16)
