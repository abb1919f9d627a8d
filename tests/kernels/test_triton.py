"""Triton kernels vs the torch reference on fresh random inputs: on CUDA, or on the CPU under
Triton's interpreter with smaller shapes and fp16 for bf16 (kernel_env); the transfer kernel and
engine need CUDA.

Tolerances (issue 6): relative error (norm of the difference / norm of the reference) under 1e-2
in bf16 (and fp16) and under 1e-4 in fp32. The reference runs in fp32 on the same (rounded) inputs.
"""
from __future__ import annotations

import time

import kernel_env as env  # first: it may turn on Triton's interpreter
import pytest
import torch
from paged_inputs import extend_case, fresh_gen, paged_slots, random_pool, rel_err, table_of

from hicache.kernels import attention as ref

pytestmark = env.kernels
if env.CUDA or env.INTERPRETED:
    from hicache.kernels.decode import decode_attention
    from hicache.kernels.extend import extend_attention
    from hicache.kernels.store import store_kv
    from hicache.kernels.transfer import copy_kv, layer_pointers

DEV = env.DEV
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
HALF = env.half(torch.bfloat16)
GROUPS = env.sizes([(8, 8), (32, 8), (32, 4)], [(2, 2), (8, 2), (8, 1)])  # (Hq, Hkv): GQA 1, 4, 8


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("d", [128, 64])
def test_decode_ragged(dtype, hq, hkv, page_size, d):
    gen = fresh_gen()
    lens = env.sizes([1, 17, 300, 64, 1000, 2049, 5, 30000], [1, 17, 300, 64, 5, 700])
    slots, num_slots = paged_slots(lens, page_size, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(len(lens), hq, d, generator=gen, device=DEV).to(dtype)
    seq_lens = torch.tensor(lens, device=DEV)
    want = ref.decode_attention(q.float(), k_buf.float(), v_buf.float(), table[rows], seq_lens, d ** -0.5)
    for splits in (None, 1, 7):
        out = decode_attention(q, k_buf, v_buf, table, rows, seq_lens, d ** -0.5, num_splits=splits)
        assert out.dtype == dtype
        assert rel_err(out, want) < TOL[dtype], (splits, rel_err(out, want))
        for i in range(len(lens)):  # no request hides behind the others' norm
            assert rel_err(out[i], want[i]) < TOL[dtype], (splits, i)


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
@pytest.mark.parametrize("hq,hkv", GROUPS)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("batch", ["ragged", "long_prefix"])
def test_extend_with_prefix(dtype, hq, hkv, page_size, batch):
    gen = fresh_gen()
    d = 128
    prefixes, extends = env.sizes({"ragged": ([0, 0, 37, 500, 1000, 64], [1, 200, 129, 1, 300, 64]),
                                   "long_prefix": ([30000, 0], [100, 257])},
                                  {"ragged": ([0, 0, 37, 100, 64], [1, 70, 129, 1, 64]),
                                   "long_prefix": ([1000, 0], [30, 70])})[batch]
    c = extend_case(prefixes, extends, page_size, hq, hkv, d, dtype, gen)
    out = extend_attention(c.q, c.k_buf, c.v_buf, c.table, c.rows, c.prefix_lens, c.extend_lens, c.starts,
                           max(extends), d ** -0.5)
    want = ref.extend_attention(c.q.float(), c.k_buf.float(), c.v_buf.float(), c.slots, extends, d ** -0.5)
    assert out.dtype == dtype
    assert rel_err(out, want) < TOL[dtype]
    for s, e in zip(c.starts.tolist(), extends):
        assert rel_err(out[s:s + e], want[s:s + e]) < TOL[dtype]


def test_extend_head_dim_64_int32_table():
    gen = fresh_gen()
    hq, hkv, d, dtype = 9, 3, 64, HALF  # SmolLM2's heads
    prefixes, extends = [0, 130, 7], [70, 33, 1]
    slots, num_slots = paged_slots([p + e for p, e in zip(prefixes, extends)], 1, gen)
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    table, rows = table_of(slots)
    q = torch.randn(sum(extends), hq, d, generator=gen, device=DEV).to(dtype)
    lens = torch.tensor(extends, device=DEV, dtype=torch.int32)
    starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    out = extend_attention(q, k_buf, v_buf, table.int(), rows.int(), torch.tensor(prefixes, device=DEV, dtype=torch.int32),
                           lens, starts, max(extends), d ** -0.5)
    want = ref.extend_attention(q.float(), k_buf.float(), v_buf.float(), slots, extends, d ** -0.5)
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [HALF, torch.float32])
def test_store_kv_strided_v(dtype):
    gen = fresh_gen()
    t, hkv, d, num_slots = 77, 3, 64, 512
    k_buf, v_buf = random_pool(num_slots, hkv, d, dtype, gen)
    want_k, want_v = k_buf.clone(), v_buf.clone()
    qkv = torch.randn(t, (3 + 2 * hkv) * d, generator=gen, device=DEV).to(dtype)  # as a fused projection
    k = qkv[:, 3 * d:(3 + hkv) * d].reshape(t, hkv, d).contiguous()
    v = qkv[:, (3 + hkv) * d:].view(t, hkv, d)  # strided rows
    loc = torch.randperm(num_slots, generator=gen, device=DEV)[:t]
    store_kv(k_buf, v_buf, loc, k, v)
    ref.store_kv(want_k, want_v, loc, k, v)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_blocks", [0, 3])  # 3: few programs, each looping over token blocks
@env.needs_cuda  # device pointers and pinned memory
def test_transfer_load_and_backup(layout, page_size, dtype, max_blocks):
    from hicache.tiers.host.pool import HostKVPool

    gen = fresh_gen()
    layers, hkv, d, dev_slots, host_tokens = 4, 3, 64, 4096, 8192
    host = HostKVPool(host_tokens, page_size, layers, hkv, d, dtype, layout, pin=True)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=gen, device=DEV).to(dtype).cpu())
    k_bufs = [torch.randn(dev_slots, hkv, d, generator=gen, device=DEV).to(dtype) for _ in range(layers)]
    v_bufs = [torch.randn(dev_slots, hkv, d, generator=gen, device=DEV).to(dtype) for _ in range(layers)]
    ptrs = layer_pointers(k_bufs, v_bufs)
    n_pages = 40
    host_pages = torch.randperm(host_tokens // page_size, generator=gen, device=DEV)[:n_pages]
    dev_pages = torch.randperm(dev_slots // page_size, generator=gen, device=DEV)[:n_pages]
    ar = torch.arange(page_size, device=DEV)
    hslots = (host_pages[:, None] * page_size + ar).reshape(-1)
    dslots = (dev_pages[:, None] * page_size + ar).reshape(-1)

    for layer in range(layers):  # load-back, one launch per layer
        copy_kv(host.buffer, layout, ptrs, hslots, dslots, range(layer, layer + 1), to_host=False,
                max_blocks=max_blocks)
    torch.cuda.synchronize()
    for layer in range(layers):
        hk, hv = host.get_layer(layer, hslots.cpu())
        assert torch.equal(k_bufs[layer][dslots].cpu(), hk) and torch.equal(v_bufs[layer][dslots].cpu(), hv)

    for b in k_bufs + v_bufs:  # new device contents, then backup all layers in one launch
        b.copy_(torch.randn(b.shape, generator=gen, device=DEV).to(dtype))
    before = host.buffer.clone()
    copy_kv(host.buffer, layout, ptrs, hslots, dslots, range(layers), to_host=True, max_blocks=max_blocks)
    torch.cuda.synchronize()
    want = HostKVPool(host_tokens, page_size, layers, hkv, d, dtype, layout, pin=False)
    want.buffer.copy_(before)
    for layer in range(layers):
        want.set_layer(layer, hslots.cpu(), k_bufs[layer][dslots], v_bufs[layer][dslots])
    assert torch.equal(host.buffer, want.buffer)  # the backed-up slots changed, no other byte did


def test_launchers_reject_bad_arguments():
    k_buf = torch.zeros(16, 2, 64, device=DEV, dtype=torch.bfloat16)
    table = torch.zeros(2, 16, dtype=torch.int64, device=DEV)
    one = torch.ones(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="not a multiple"):
        decode_attention(torch.zeros(1, 3, 64, device=DEV, dtype=torch.bfloat16), k_buf, k_buf, table, one, one, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(torch.zeros(1, 4, 64, device=DEV), k_buf, k_buf, table, one, one, 1.0)
    if env.CUDA:  # (the interpreter takes CPU tensors)
        with pytest.raises(ValueError, match="CUDA"):
            decode_attention(torch.zeros(1, 4, 64, dtype=torch.bfloat16), k_buf, k_buf, table, one, one, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(torch.zeros(1, 4, 64, device=DEV, dtype=torch.bfloat16), k_buf, k_buf, table, one,
                         torch.ones(2, dtype=torch.int64, device=DEV), 1.0)
    with pytest.raises(ValueError, match="extend_lens"):
        extend_attention(torch.zeros(1, 4, 64, device=DEV, dtype=torch.bfloat16), k_buf, k_buf, table, one, one,
                         torch.ones(2, dtype=torch.int64, device=DEV), one, 1, 1.0)
    with pytest.raises(ValueError, match="loc"):
        store_kv(k_buf, k_buf, one.float(), torch.zeros(1, 2, 64, device=DEV, dtype=torch.bfloat16),
                 torch.zeros(1, 2, 64, device=DEV, dtype=torch.bfloat16))


@env.needs_cuda  # device pointers, pinned memory
def test_transfer_kernel_rejects_bad_arguments():
    k_buf = torch.zeros(16, 2, 64, device=DEV, dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.int64, device=DEV)
    ptrs = layer_pointers([k_buf], [k_buf])
    with pytest.raises(ValueError, match="pinned"):
        copy_kv(torch.zeros(2, 1, 16, 2, 64, dtype=torch.bfloat16), "layer_first", ptrs, one, one, range(1), False)
    with pytest.raises(ValueError, match="dtype"):
        copy_kv(torch.zeros(2, 1, 16, 2, 64, pin_memory=True), "layer_first", ptrs, one, one, range(1), False)


def transfer_engine(layers: int, n: int, io_backend: str = "kernel", layout: str = "layer_first"):
    """A transfer engine (io_backend "kernel": the Triton gather kernel; "direct": the copy engines,
    many copies per driver call) over a zeroed device pool and a random pinned host pool."""
    from hicache.tiers.gpu.pool import DeviceKVPool
    from hicache.tiers.host.pool import HostKVPool
    from hicache.tiers.host.transfer import HostTransferEngine

    hkv, d = 8, 128
    dev = DeviceKVPool(n, 64, layers, hkv, d, torch.bfloat16, DEV)
    host = HostKVPool(n, 64, layers, hkv, d, torch.bfloat16, layout, pin=True)
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=fresh_gen(), device=DEV, dtype=torch.bfloat16).cpu())
    for i in range(layers):
        dev.k_buffer(i).zero_()
        dev.v_buffer(i).zero_()
    torch.cuda.synchronize()
    eng = HostTransferEngine(dev, host, io_backend)
    assert (eng._batch is not None) == (io_backend == "direct"), "the copy-engine path must be the one tested"
    return eng, dev, host


def scattered_pages(n: int) -> torch.Tensor:
    return torch.randperm(n // 64)[:, None].mul(64).add(torch.arange(64)).view(-1)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@env.needs_cuda
def test_transfer_engine_load_waits_per_layer(io_backend):
    """A load-back leaves the compute stream free; `wait_layer(ticket, i)` orders what compute does
    next after layer i of the load alone (what the forward pass does before layer i's attention).
    The pages are scattered; the Triton gather kernel or the copy engines copy them."""
    layers, n = 8, 32768  # 1 GiB: ~20 ms at the pinned H2D rate
    eng, dev, host = transfer_engine(layers, n, io_backend)
    slots, dst = scattered_pages(n), torch.arange(n)
    ticket = eng.load(slots, dst)
    free = torch.cuda.Event()
    free.record()
    free.synchronize()  # compute did not wait for the whole load
    assert eng.in_flight() == 1 and not eng.poll()
    snaps = []
    for i in range(layers):
        eng.wait_layer(ticket, i)
        snaps.append((dev.k_buffer(i).clone(), dev.v_buffer(i).clone()))
    torch.cuda.synchronize()
    for i, (k, v) in enumerate(snaps):
        hk, hv = host.get_layer(i, slots)
        assert torch.equal(k[dst].cpu(), hk) and torch.equal(v[dst].cpu(), hv), f"layer {i} read before it landed"
    res = eng.poll()
    assert [(r.ticket, r.ok) for r in res] == [(ticket, True)]
    eng.wait_layer(ticket, 0)  # finished: nothing to wait for


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@env.needs_cuda
def test_transfer_engine_batches_loads_layer_by_layer(io_backend):
    """The loads of one batch's requests are queued together, layer by layer: layer i of every
    load is copied before layer i + 1 of any, so that the batch's layer 0 does not wait for whole
    loads queued one after another. Each load's pages land where it asked, layer by layer."""
    layers, n = 4, 8192
    eng, dev, host = transfer_engine(layers, n, io_backend)
    slots, dst = scattered_pages(n), torch.randperm(n)
    order, loads = [], []
    for part in range(3):  # three requests' loads of different lengths
        lo, hi = [0, 1024, 4096, n][part], [0, 1024, 4096, n][part + 1]
        ticket = eng.load(slots[lo:hi], dst[lo:hi], on_layer=lambda i, part=part: order.append((i, part)))
        loads.append((ticket, slots[lo:hi], dst[lo:hi]))
    snaps = []
    for i in range(layers):
        for ticket, _, _ in loads:
            eng.wait_layer(ticket, i)
        snaps.append((dev.k_buffer(i).clone(), dev.v_buffer(i).clone()))
    assert order == [(i, part) for i in range(layers) for part in range(3)]
    torch.cuda.synchronize()
    for i, (k, v) in enumerate(snaps):
        for _, src, to in loads:
            hk, hv = host.get_layer(i, src)
            assert torch.equal(k[to].cpu(), hk) and torch.equal(v[to].cpu(), hv), f"layer {i} read before it landed"
    eng.synchronize(loads[-1][0])
    assert sorted(r.ticket for r in eng.poll() if r.ok) == sorted(t for t, _, _ in loads)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@env.needs_cuda
def test_transfer_times_are_the_copies_busy_time_and_queueing_apart(io_backend):
    """Loads queued together report, each, its share by bytes of their copies' stream time, and the
    rest of their time from submission (here: held back before start_loads) as `waited`; the
    shares add up to one busy time, which no link could beat and which is far below the wait."""
    layers, n = 8, 16384  # 256 MiB
    eng, dev, host = transfer_engine(layers, n, io_backend)
    slots, dst = scattered_pages(n), torch.randperm(n)
    tickets = [eng.load(slots[lo:hi], dst[lo:hi]) for lo, hi in ((0, 4096), (4096, n))]
    time.sleep(0.3)  # queued behind nothing, but not started: waiting, not copying
    eng.start_loads(whole=True)
    torch.cuda.synchronize()
    res = {r.ticket: r for r in eng.poll()}
    assert sorted(res) == sorted(tickets) and all(r.ok for r in res.values())
    a, b = res[tickets[0]], res[tickets[1]]
    busy = a.seconds + b.seconds
    assert a.seconds == pytest.approx(busy * 4096 / n, rel=1e-6), "shares follow the bytes"
    nbytes = a.nbytes + b.nbytes
    assert nbytes / busy < 1e12, f"{nbytes / busy / 1e9:.0f} GB/s: no host link moves that"
    assert a.waited >= 0.3 and b.waited >= 0.3 and busy < 0.3, (a, b)


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@env.needs_cuda
def test_transfer_engine_start_loads_lands_a_load_nobody_waits_for(io_backend):
    """A load is deferred until a forward pass waits for it; poll() alone never starts it (the
    loads of one batch go together), start_loads() does (the scheduler calls it once a step)."""
    layers, n = 2, 1024
    eng, dev, host = transfer_engine(layers, n, io_backend)
    slots, dst = scattered_pages(n), torch.arange(n)
    ticket = eng.load(slots, dst)
    torch.cuda.synchronize()
    assert eng.poll() == [] and eng.in_flight() == 1
    eng.start_loads()
    deadline = time.monotonic() + 10
    done = []
    while not done and time.monotonic() < deadline:
        done = eng.poll()
    assert [(r.ticket, r.ok) for r in done] == [(ticket, True)]
    for i in range(layers):
        hk, hv = host.get_layer(i, slots)
        assert torch.equal(dev.k_buffer(i)[dst].cpu(), hk) and torch.equal(dev.v_buffer(i)[dst].cpu(), hv)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@env.needs_cuda
def test_transfer_engine_backup_and_load_round_trip(io_backend, layout):
    """A backup of scattered device pages (every layer) lands in the host slots asked for, and a
    load of them back lands in other device slots, in both host layouts."""
    layers, n = 4, 8192
    eng, dev, host = transfer_engine(layers, n, io_backend, layout)
    for i in range(layers):
        dev.k_buffer(i).copy_(torch.randn(dev.k_buffer(i).shape, generator=fresh_gen(), device=DEV, dtype=torch.bfloat16))
        dev.v_buffer(i).copy_(torch.randn(dev.v_buffer(i).shape, generator=fresh_gen(), device=DEV, dtype=torch.bfloat16))
    src, hslots = scattered_pages(n)[: n // 2], scattered_pages(n)[: n // 2]
    ticket = eng.backup(src, hslots)
    eng.synchronize(ticket)
    for i in range(layers):
        hk, hv = host.get_layer(i, hslots)
        assert torch.equal(hk, dev.k_buffer(i)[src].cpu()) and torch.equal(hv, dev.v_buffer(i)[src].cpu())
    dst = scattered_pages(n)[: n // 2]
    ticket = eng.load(hslots, dst)
    eng.synchronize(ticket)
    for i in range(layers):
        hk, hv = host.get_layer(i, hslots)
        assert torch.equal(dev.k_buffer(i)[dst].cpu(), hk) and torch.equal(dev.v_buffer(i)[dst].cpu(), hv)
    assert sorted(r.ok for r in eng.poll()) == [True, True]
