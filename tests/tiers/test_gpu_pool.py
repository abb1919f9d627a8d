"""L1 pool pieces: page allocator and request-to-token table."""
from __future__ import annotations

import pytest
import torch

from hicache.tiers.gpu.allocator import PagedAllocator
from hicache.tiers.gpu.pool import DeviceKVPool
from hicache.tiers.gpu.req_table import ReqToTokenTable


@pytest.mark.parametrize("page_size", [1, 16])
def test_allocator_hands_out_whole_pages_and_takes_them_back(page_size):
    a = PagedAllocator(num_pages=8, page_size=page_size)
    s1 = a.alloc(3 * page_size)
    s2 = a.alloc(5 * page_size)
    assert a.alloc(page_size) is None and a.num_free_tokens() == 0
    everything = torch.cat([s1, s2]).sort().values
    assert torch.equal(everything, torch.arange(8 * page_size))
    for page in s1.view(-1, page_size):  # each page is a run of consecutive slots
        assert torch.equal(page - page[0], torch.arange(page_size))
    a.free(s1[page_size:])
    assert a.num_free_tokens() == 2 * page_size
    assert set(a.free_slots().tolist()) == set(s1[page_size:].tolist())


def test_allocator_rejects_partial_pages():
    a = PagedAllocator(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    with pytest.raises(ValueError, match="whole pages"):
        a.free(torch.tensor([0, 1]))


def test_pool_and_table_shapes():
    pool = DeviceKVPool(100, 16, num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32, device="cpu")
    assert pool.num_slots == 96 and pool.k_buffer(1).shape == (96, 3, 8)
    assert pool.bytes_per_token() == DeviceKVPool.token_bytes(2, 3, 8, torch.float32) == 2 * 2 * 3 * 8 * 4
    table = ReqToTokenTable(2, 32, "cpu")
    r = table.alloc()
    table.write(r, 4, torch.tensor([7, 8]))
    assert table.read(r, 6)[4:].tolist() == [7, 8]
    assert table.alloc() is not None and table.alloc() is None


def test_table_scatter_writes_as_row_writes_do():
    written, scattered = ReqToTokenTable(3, 8, "cpu"), ReqToTokenTable(3, 8, "cpu")
    slots = torch.randint(0, 1000, (5,), dtype=torch.int64)
    written.write(2, 3, slots[:3])
    written.write(0, 1, slots[3:])
    scattered.scatter([2, 2, 2, 0, 0], [3, 4, 5, 1, 2], slots)
    assert torch.equal(written.table, scattered.table)
