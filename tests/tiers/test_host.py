"""L2 pieces: host pool sizing and layouts, the locked allocator, the transfer engine."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.host.pool import GB, HostKVPool, LockedAllocator, available_ram, default_reserve, host_pool_tokens
from hicache.tiers.host.transfer import HostTransferEngine

LAYERS, HEADS, DIM = 3, 2, 4


def pools(layout, page_size=4, device_tokens=64, host_tokens=128):
    dev = DeviceKVPool(device_tokens, page_size, LAYERS, HEADS, DIM, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for i in range(LAYERS):
        dev.k_buffers[i].copy_(torch.randn(dev.k_buffers[i].shape, generator=g))
        dev.v_buffers[i].copy_(torch.randn(dev.v_buffers[i].shape, generator=g))
    host = HostKVPool(host_tokens, page_size, LAYERS, HEADS, DIM, torch.float32, layout)
    return dev, host


def test_sizing_by_ratio_or_gb_page_aligned():
    per_token = 1000
    assert host_pool_tokens(100, per_token, 16, 2.0, 0, available=10 * GB, reserve=0) == 192
    assert host_pool_tokens(100, per_token, 1, 2.0, 0.5, available=10 * GB, reserve=0) == 500_000
    with pytest.raises(ValueError, match="Not enough host memory"):
        host_pool_tokens(100, per_token, 1, 2.0, 3, available=4 * GB, reserve=2 * GB)
    with pytest.raises(ValueError, match="less than one page"):
        host_pool_tokens(10, per_token, 64, 2.0, 0, available=10 * GB, reserve=0)


def test_a_ratio_that_does_not_fit_beside_other_processes_is_sized_down_with_a_warning(caplog):
    """Another server holds the memory: the L2 derived from the ratio shrinks to what is available
    beyond the OS reserve (page-aligned) and says so; an explicit size still fails."""
    per_token = 1000
    with caplog.at_level("WARNING", logger="hicache.tiers.host.pool"):
        tokens = host_pool_tokens(10**6, per_token, 16, 2.0, 0, available=3 * GB, reserve=2 * GB)
    assert tokens == GB // per_token // 16 * 16
    assert "sized down to 1000000 tokens" in caplog.text and "hicache_ratio 2" in caplog.text
    with pytest.raises(ValueError, match="Not enough host memory"):
        host_pool_tokens(10**6, per_token, 16, 2.0, 1.5, available=3 * GB, reserve=2 * GB)
    with pytest.raises(ValueError, match="Not enough host memory"):  # not even a page beyond the reserve
        host_pool_tokens(10**6, per_token, 16, 2.0, 0, available=2 * GB + 15 * per_token, reserve=2 * GB)


def test_the_os_reserve_is_at_most_half_the_available_memory():
    """Other processes hold most of the RAM (a server beside this one): the reserve shrinks with
    what is left, so that a modest derived L2 still fits."""
    assert default_reserve(64 * GB) <= 10 * 2**30
    assert default_reserve(3 * GB) == 3 * GB // 2
    assert host_pool_tokens(8192, 46080, 16, 2.0, 0, available=3 * GB) == 16384


def test_real_ram_check_refuses_an_absurd_size_and_shrinks_an_absurd_ratio():
    with pytest.raises(ValueError, match="kept for the OS"):
        host_pool_tokens(100, 1000, 1, 2.0, 10**6)  # a petabyte
    assert 0 < host_pool_tokens(10**12, 1000, 1, 2.0, 0) * 1000 < available_ram()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_layouts_store_and_return_the_same_kv(layout):
    _, host = pools(layout)
    assert not host.pinned and host.bytes_per_token() == 2 * LAYERS * HEADS * DIM * 4
    slots = torch.tensor([5, 6, 7, 12, 100, 3])
    k, v = torch.randn(6, HEADS, DIM), torch.randn(6, HEADS, DIM)
    host.set_layer(1, slots, k, v)
    k2, v2 = host.get_layer(1, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_page_first_keeps_a_whole_page_contiguous():
    _, host = pools("page_first")
    page = torch.arange(4, 8)  # page 1
    for layer in range(LAYERS):
        host.set_layer(layer, page, torch.full((4, HEADS, DIM), float(layer)), torch.full((4, HEADS, DIM), -float(layer)))
    view = host.page_view(1)
    assert view.is_contiguous() and view.shape == (2, LAYERS, 4, HEADS, DIM)
    assert view.data_ptr() == host.buffer.data_ptr() + host.buffer[0].numel() * 4
    assert torch.equal(view[0, 2], torch.full((4, HEADS, DIM), 2.0)) and torch.equal(view[1, 1], torch.full((4, HEADS, DIM), -1.0))
    with pytest.raises(ValueError):
        pools("layer_first")[1].page_view(0)
    with pytest.raises(ValueError, match="hicache_mem_layout"):
        HostKVPool(16, 4, 1, 1, 1, torch.float32, "page_head")


def test_locked_allocator_survives_concurrent_use():
    a = LockedAllocator(num_pages=64, page_size=2)

    def churn():
        for _ in range(300):
            s = a.alloc(4)
            if s is not None:
                a.free(s)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.num_free_tokens() == 128 and sorted(a.free_slots().tolist()) == list(range(128))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_backup_then_load_back_round_trips_every_layer(layout, io_backend):
    dev, host = pools(layout)
    eng = HostTransferEngine(dev, host, io_backend)
    src = torch.tensor([8, 9, 10, 11, 40, 41, 42, 43])
    hslots = torch.tensor([20, 21, 22, 23, 0, 1, 2, 3])
    want = [(dev.k_buffer(i)[src].clone(), dev.v_buffer(i)[src].clone()) for i in range(LAYERS)]
    t1 = eng.backup(src, hslots)
    dst = torch.tensor([60, 61, 62, 63, 4, 5, 6, 7])
    layers = []
    t2 = eng.load(hslots, dst, on_layer=layers.append)
    done = eng.poll()
    assert [(r.ticket, r.kind, r.ok, r.tokens) for r in done] == [(t1, "backup", True, 8), (t2, "load", True, 8)]
    assert done[0].nbytes == 8 * host.bytes_per_token() and done[0].seconds >= 0
    assert layers == list(range(LAYERS)) and eng.poll() == []
    for i, (k, v) in enumerate(want):
        assert torch.equal(dev.k_buffer(i)[dst], k) and torch.equal(dev.v_buffer(i)[dst], v)
    eng.synchronize(t2)  # a no-op once done


def test_a_failing_copy_is_reported_not_raised(monkeypatch):
    dev, host = pools("layer_first")
    eng = HostTransferEngine(dev, host)

    def boom(*a, **k):
        raise RuntimeError("DMA error")

    monkeypatch.setattr(host, "set_layer", boom)
    t = eng.backup(torch.arange(4), torch.arange(4))
    bad = eng.load(torch.arange(4), torch.arange(8))  # mismatched lengths
    res = {r.ticket: r for r in eng.poll()}
    assert not res[t].ok and "DMA error" in res[t].error and res[t].nbytes == 0
    assert not res[bad].ok and "host slots" in res[bad].error


def test_engine_rejects_bad_backend_and_layer_mismatch():
    dev, host = pools("layer_first")
    with pytest.raises(ValueError, match="hicache_io_backend"):
        HostTransferEngine(dev, host, "dma")
    other = HostKVPool(16, 4, LAYERS + 1, HEADS, DIM, torch.float32)
    with pytest.raises(ValueError, match="layers"):
        HostTransferEngine(dev, other)


def test_slot_runs_pair_up_slots_contiguous_on_both_sides():
    from hicache.tiers.host.copy_engine import slot_runs

    def pages(ps, size=4):
        return np.concatenate([np.arange(p * size, p * size + size) for p in ps])

    # the allocator hands out pages in descending order: host and device runs still pair up
    h, d, n = slot_runs(pages([5, 4, 3]), pages([9, 8, 7]))
    assert (h.tolist(), d.tolist(), n.tolist()) == ([12], [28], [12])
    h, d, n = slot_runs(pages([5, 4, 3]), pages([9, 2, 7]))
    assert (h.tolist(), d.tolist(), n.tolist()) == ([12, 16, 20], [28, 8, 36], [4, 4, 4])
    h, d, n = slot_runs(pages([5, 4, 3]), pages([9, 8, 7]), host_page=4)  # page_first: a run per host page
    assert (h.tolist(), d.tolist(), n.tolist()) == ([12, 16, 20], [28, 32, 36], [4, 4, 4])
    assert [a.size for a in slot_runs(np.zeros(0, np.int64), np.zeros(0, np.int64))] == [0, 0, 0]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_page_copies_address_the_same_bytes_as_the_index_copies(layout):
    """The copy engine's (dst, src, size) list, carried out here with memmove on CPU buffers, moves
    exactly what the pool's get_layer / set_layer index copies move, both ways, in both layouts."""
    import ctypes

    from hicache.tiers.host.copy_engine import page_copies

    dev, host = pools(layout, device_tokens=64, host_tokens=256)
    g = torch.Generator().manual_seed(3)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=g))
    # scattered pages, some adjacent on both sides (runs), in a shuffled order
    hslots = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in [7, 8, 9, 2, 30, 31, 12]])
    dslots = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in [3, 4, 6, 11, 0, 1, 14]])
    perm = torch.randperm(hslots.numel(), generator=g)
    hslots, dslots = hslots[perm], dslots[perm]

    def run(copies):
        for dst, src, size in zip(*(a.reshape(-1).tolist() for a in copies)):
            ctypes.memmove(dst, src, size)

    ks = [dev.k_buffer(i) for i in range(LAYERS)]
    vs = [dev.v_buffer(i) for i in range(LAYERS)]
    copies = page_copies(host, ks, vs, hslots, dslots, range(LAYERS), to_host=False)
    assert copies[0].shape[:2] == (2, LAYERS) and copies[0].shape[2] < hslots.numel() // 4 + 2  # runs merged
    run(copies)
    for i in range(LAYERS):
        k, v = host.get_layer(i, hslots)
        assert torch.equal(dev.k_buffer(i)[dslots], k) and torch.equal(dev.v_buffer(i)[dslots], v)
    for i in range(LAYERS):  # now the other way, onto other host slots, layer 1 only
        dev.k_buffer(i).copy_(torch.randn(dev.k_buffer(i).shape, generator=g))
        dev.v_buffer(i).copy_(torch.randn(dev.v_buffer(i).shape, generator=g))
    back = hslots + 64
    untouched = [host.get_layer(i, back) for i in (0, 2)]
    run(page_copies(host, ks, vs, back, dslots, [1], to_host=True))
    k, v = host.get_layer(1, back)
    assert torch.equal(k, dev.k_buffer(1)[dslots]) and torch.equal(v, dev.v_buffer(1)[dslots])
    for i, (k, v) in zip((0, 2), untouched):  # only the layers asked for
        assert torch.equal(host.get_layer(i, back)[0], k) and torch.equal(host.get_layer(i, back)[1], v)
