"""Scattered host <-> device page copies on the copy engines, many in one driver call.

`cuMemcpyBatchAsync` (CUDA drivers 12.8 and later) queues a list of (dst, src, size) copies on a
stream in one call; the DMA engines run them at the link's rate and no SM is taken from the
compute they overlap (the Triton gather kernel of io_backend "kernel" holds SMs, and a load-back
beside an extend slows both). One call per layer of scattered pages measured about as fast as one
large copy (benchmarks/RESULTS.md). The driver spends host time on every copy in the call, so
`page_copies` first pairs the slots up into runs contiguous on both sides (pages backed up
together were allocated together), and the transfer engine queues a load's layers as the forward
pass reaches them rather than all at once before it.

`page_copies` is plain address arithmetic over the pools' buffers (tested on CPU tensors);
`BatchCopier` needs a CUDA driver.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch

_SRC_ACCESS_ORDER_STREAM = 1  # CUmemcpySrcAccessOrder: read the source in stream order
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CUmemLocationType
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1  # CUmemcpyFlags


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


def slot_runs(host_slots: np.ndarray, device_slots: np.ndarray, host_page: int = 0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(host start, device start, length) of the runs in which host_slots[i] -> device_slots[i]
    both advance by one, in host order; with host_page > 0 a run also ends at a host page's end
    (page_first: a page's slots of one layer are contiguous, the next page's are not)."""
    order = np.argsort(host_slots, kind="stable")
    h, d = host_slots[order], device_slots[order]
    starts = np.ones(h.size, dtype=bool)
    starts[1:] = (np.diff(h) != 1) | (np.diff(d) != 1)
    if host_page > 0:
        starts |= h % host_page == 0
    first = np.flatnonzero(starts)
    return h[first], d[first], np.diff(np.append(first, h.size))


def page_copies(host_pool, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor],
                host_slots: torch.Tensor, device_slots: torch.Tensor, layers: Sequence[int], to_host: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The byte copies that move K and V of `layers` between host slot host_slots[i] of
    `host_pool` (a `HostKVPool`, either layout) and device slot device_slots[i] of the per-layer
    [slots, H, D] buffers, in the direction `to_host`: (dsts, srcs, sizes) addresses and byte
    counts, each [2 (K, V), len(layers), runs] int64."""
    row = k_buffers[0][0].numel() * k_buffers[0].element_size()  # bytes of one slot of one layer
    page_first = host_pool.layout == "page_first"
    h, d, n = slot_runs(host_slots.numpy(), device_slots.numpy(), host_pool.page_size if page_first else 0)
    num_layers, page = host_pool.num_layers, host_pool.page_size
    kv = np.arange(2, dtype=np.int64)[:, None, None]
    layer = np.asarray(layers, dtype=np.int64)[None, :, None]
    if page_first:  # [pages, 2, L, page_size, H, D]
        host_rows = (h // page * 2 * num_layers * page) + (kv * num_layers + layer) * page + h % page
    else:  # [2, L, slots, H, D]
        host_rows = (kv * num_layers + layer) * host_pool.num_slots + h
    host_addr = host_pool.buffer.data_ptr() + host_rows * row
    bases = np.array([[b.data_ptr() for b in k_buffers], [b.data_ptr() for b in v_buffers]], dtype=np.int64)
    dev_addr = bases[:, list(layers)][:, :, None] + d * row
    sizes = np.broadcast_to(n * row, host_addr.shape)
    dsts, srcs = (host_addr, dev_addr) if to_host else (dev_addr, host_addr)
    return dsts, srcs, sizes


class BatchCopier:
    """`cuMemcpyBatchAsync` through ctypes (the driver API: no extra package). RuntimeError, naming
    what is missing, when the driver is older than 12.8."""

    def __init__(self, device: torch.device):
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        # CUDA 13 dropped the failIdx argument (cuMemcpyBatchAsync_v2); 12.8/12.9 have it.
        self._fail_idx = version.value < 13000
        name = "cuMemcpyBatchAsync" if self._fail_idx else "cuMemcpyBatchAsync_v2"
        if version.value < 12080 or not hasattr(lib, name):
            raise RuntimeError(f"copy-engine batches need cuMemcpyBatchAsync (CUDA driver 12.8+); "
                               f"this driver is {version.value // 1000}.{version.value % 1000 // 10}")
        self._fn = getattr(lib, name)
        self._fn.restype = ctypes.c_int
        index = device.index if device.index is not None else torch.cuda.current_device()
        host, dev = _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, index)
        self._attrs = {to_host: _Attributes(_SRC_ACCESS_ORDER_STREAM, dev if to_host else host,
                                            host if to_host else dev, _FLAG_PREFER_OVERLAP_WITH_COMPUTE)
                       for to_host in (False, True)}
        self._first = (ctypes.c_size_t * 1)(0)  # one set of attributes, from copy 0 on

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, to_host: bool, stream) -> None:
        """Queues the copies (byte addresses and sizes, any shape) on `stream`: a torch.cuda.Stream
        other than the legacy default stream, which the driver refuses. Host memory must be pinned."""
        if stream.cuda_stream == 0:
            raise ValueError("cuMemcpyBatchAsync needs a created stream, not the legacy default stream")
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64).reshape(-1) for a in (dsts, srcs, sizes))
        if dsts.size == 0:
            return
        args = [ctypes.c_void_p(dsts.ctypes.data), ctypes.c_void_p(srcs.ctypes.data),
                ctypes.c_void_p(sizes.ctypes.data), ctypes.c_size_t(dsts.size), ctypes.byref(self._attrs[to_host]),
                self._first, ctypes.c_size_t(1)]
        failed = ctypes.c_size_t(0)
        if self._fail_idx:
            args.append(ctypes.byref(failed))
        rc = self._fn(*args, ctypes.c_void_p(stream.cuda_stream))
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync of {dsts.size} copies failed: CUresult {rc}"
                               + (f" (copy {failed.value})" if self._fail_idx else ""))
