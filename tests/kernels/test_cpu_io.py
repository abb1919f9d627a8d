"""The compiled checked copies of L3 pages (`kernels/cpu_io.py`) against the crc32c package and
plain tensor copies, on fresh random bytes and both host layouts' page shapes."""
from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch

from hicache.kernels import cpu_io

pytestmark = pytest.mark.skipif(cpu_io.library() is None, reason="no C++ compiler")


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 63, 4096 + 5, 1 << 20])
def test_crc32c_matches_the_package(size):
    data = np.random.randint(0, 256, size, dtype=np.uint8).tobytes()
    assert cpu_io.crc32c(data) == crc32c.crc32c(data)


def layer_first(slots=32, page=4, layers=3, heads=2, dim=8, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(2, layers, slots, heads, dim).to(dtype)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_copy_crc_then_check_copy_round_trips_and_refuses_a_bad_checksum(layout):
    pool = layer_first() if layout == "layer_first" else torch.randn(8, 2, 3, 4, 2, 8)
    pages = [pool[:, :, 4:8] if layout == "layer_first" else pool[1], pool[:, :, 12:16] if layout == "layer_first"
             else pool[5]]
    values, crcs = [], []
    for page in pages:
        out = np.empty(page.numel() * page.element_size(), dtype=np.uint8)
        crcs.append(cpu_io.copy_crc(cpu_io.runs(page), out))
        assert bytes(out) == page.contiguous().view(torch.uint8).numpy().tobytes()
        assert crcs[-1] == crc32c.crc32c(out)
        values.append(out)
    dest = torch.zeros_like(pool)
    targets = [dest[:, :, 20:24], dest[:, :, 0:4]] if layout == "layer_first" else [dest[2], dest[6]]
    corrupt = values[1].copy()
    corrupt[len(corrupt) // 2] ^= 1
    ok = cpu_io.check_copy([values[0].data, corrupt.data], [cpu_io.runs(t) for t in targets], crcs, threads=2)
    assert ok == [True, False]
    assert torch.equal(targets[0], pages[0])
    assert not targets[1].any(), "a page whose checksum failed was written"


def test_runs_describes_only_what_it_can_copy():
    pool = layer_first()
    assert cpu_io.runs(pool[:, :, 4:8]).runs == 2 * 3
    whole = cpu_io.runs(pool)
    assert whole.runs == 1 and whole.run_bytes == pool.numel() * pool.element_size()
    assert cpu_io.runs(pool.transpose(3, 4)) is None  # no contiguous innermost block
    assert cpu_io.runs(pool[:, :, 0:0]) is None


def test_check_copy_refuses_a_payload_of_the_wrong_size():
    page = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="payload"):
        cpu_io.check_copy([bytes(8)], [cpu_io.runs(page)], [0], threads=1)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_backend_batch_round_trips_and_refuses_a_flipped_byte_with_or_without_the_library(monkeypatch, compiled):
    """The compiled path and the per-page one it falls back to frame and check alike: the pages
    come back equal, and a value with a flipped payload byte is a counted miss that leaves its
    page untouched."""
    from hicache.tiers.remote.memory import MemoryBackend

    if not compiled:
        monkeypatch.setattr(cpu_io, "library", lambda: None)
    pool = layer_first(slots=64)
    pages = [pool[:, :, i * 4:(i + 1) * 4] for i in range(6)]
    backend = MemoryBackend("ns")
    keys = [f"{i:064x}" for i in range(6)]
    assert backend.batch_set(keys, pages) == 6
    raw = backend.storage_key(keys[2])
    flipped = bytearray(backend._data[raw.decode()])
    flipped[-1] ^= 0x40
    backend._data[raw.decode()] = bytes(flipped)
    dest = torch.zeros_like(pool)
    targets = [dest[:, :, i * 4:(i + 1) * 4] for i in range(6)]
    assert backend.batch_get(keys, targets) == [True, True, False, True, True, True]
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(targets[i], pages[i])
    assert not targets[2].any()
    assert backend.stats()["corrupt_pages"] == 1
