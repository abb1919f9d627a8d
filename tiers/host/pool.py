"""L2: the host KV pool, its layouts and its thread-safe page allocator."""
from __future__ import annotations

import logging
import math
import mmap
import os
import threading

import torch

from hicache.tiers.base import PagedAllocator

LAYOUTS = ("layer_first", "page_first")
GB = 10**9  # hicache_size is in GB, as SGLang's --hicache-size
logger = logging.getLogger(__name__)


class LockedAllocator:
    """`PagedAllocator` behind a lock: the scheduler allocates and frees host pages, and later the
    storage I/O threads do too. Same contract as `tiers.base.PageAllocator`."""

    def __init__(self, num_pages: int, page_size: int):
        self._inner = PagedAllocator(num_pages, page_size)
        self._lock = threading.Lock()
        self.page_size = page_size
        self.num_pages = num_pages

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        with self._lock:
            return self._inner.alloc(num_tokens)

    def free(self, slots: torch.Tensor) -> None:
        with self._lock:
            self._inner.free(slots)

    def num_free_tokens(self) -> int:
        with self._lock:
            return self._inner.num_free_tokens()

    def capacity_tokens(self) -> int:
        return self._inner.capacity_tokens()

    def free_slots(self) -> torch.Tensor:
        with self._lock:
            return self._inner.free_slots()


class HostKVPool:
    """K and V of every layer for `num_tokens` host slots, in one buffer.

    layer_first: buffer [2, num_layers, num_slots, num_kv_heads, head_dim] (K = 0, V = 1): layer i
      of K is one contiguous [num_slots, H, D] block, the same shape as an L1 layer.
    page_first: buffer [num_pages, 2, num_layers, page_size, H, D]: everything of one page
      (K and V, all layers) is one contiguous block, so one L3 object is one slice (`page_view`).
    dtype is the L1 pool's; the buffer is pinned when `pin` (default: when CUDA is available).
    With `shared`, the buffer is shared memory (a memfd, `shared_fd`) that a storage process maps
    too (`HostKVPool.attach`); pinned by registering it with CUDA.
    Slots are token indices, as in L1; `allocator` hands them out a page at a time.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, layout: str = "layer_first", pin: bool | None = None, shared: bool = False,
                 fd: int | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"hicache_mem_layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
        num_pages = num_tokens // page_size
        if num_pages < 1:
            raise ValueError(f"the host KV pool holds {num_tokens} tokens, less than one page ({page_size})")
        self.page_size, self.num_layers, self.layout = page_size, num_layers, layout
        self.num_slots = num_pages * page_size
        self.allocator = LockedAllocator(num_pages, page_size)
        if layout == "layer_first":
            shape = (2, num_layers, self.num_slots, num_kv_heads, head_dim)
        else:
            shape = (num_pages, 2, num_layers, page_size, num_kv_heads, head_dim)
        pin = torch.cuda.is_available() if pin is None else pin
        self.spec = {"num_tokens": num_tokens, "page_size": page_size, "num_layers": num_layers,
                     "num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."),
                     "layout": layout}
        self.shared_fd = None
        if shared or fd is not None:
            self.shared_fd = _memfd(math.prod(shape) * dtype.itemsize) if fd is None else fd
            self.buffer = _map(self.shared_fd, shape, dtype)
            if pin:
                _register(self.buffer)
        else:
            self.buffer = torch.empty(shape, dtype=dtype, pin_memory=pin)  # untouched pages cost no RAM on CPU
        self.pinned = pin
        self._token_bytes = 2 * num_layers * num_kv_heads * head_dim * self.buffer.element_size()

    @classmethod
    def attach(cls, fd: int, spec: dict) -> HostKVPool:
        """The pool whose shared buffer is the memfd `fd`, as `spec` (another pool's) describes it:
        the same pages, unpinned (for the storage process)."""
        return cls(**{**spec, "dtype": getattr(torch, spec["dtype"])}, pin=False, fd=fd)

    def close(self) -> None:
        """Done with a shared pool: its registration with CUDA ends (else memory mapped later at the
        same address could not be registered) and its memfd closes; the buffer stays readable."""
        if self.shared_fd is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        os.close(self.shared_fd)
        self.shared_fd = None

    def bytes_per_token(self) -> int:
        return self._token_bytes

    def get_layer(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` at host `slots` ([n] int64, CPU): two new [n, H, D] tensors."""
        if self.layout == "layer_first":
            return self.buffer[0, layer, slots], self.buffer[1, layer, slots]
        pages, offs = slots // self.page_size, slots % self.page_size
        return self.buffer[pages, 0, layer, offs], self.buffer[pages, 1, layer, offs]

    def set_layer(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes [n, H, D] K and V (any device: copied here) of `layer` at host `slots`."""
        if self.layout == "layer_first":
            self.buffer[0, layer, slots] = k.to("cpu")
            self.buffer[1, layer, slots] = v.to("cpu")
            return
        pages, offs = slots // self.page_size, slots % self.page_size
        self.buffer[pages, 0, layer, offs] = k.to("cpu")
        self.buffer[pages, 1, layer, offs] = v.to("cpu")

    def page(self, first_slot: int) -> torch.Tensor:
        """The page starting at host slot `first_slot` as a [2, L, page_size, H, D] view (K = 0,
        V = 1): contiguous for page_first, strided for layer_first. L3 values are this shape."""
        if self.layout == "page_first":
            return self.buffer[first_slot // self.page_size]
        return self.buffer[:, :, first_slot:first_slot + self.page_size]

    def page_view(self, page: int) -> torch.Tensor:
        """page_first only: page `page` as one contiguous [2, L, page_size, H, D] view (for L3)."""
        if self.layout != "page_first":
            raise ValueError("page_view needs the page_first layout")
        return self.buffer[page]


def _memfd(nbytes: int) -> int:
    fd = os.memfd_create("hicache-l2", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)  # pages cost RAM once touched
    return fd


def _map(fd: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if os.fstat(fd).st_size != nbytes:
        raise ValueError(f"the shared host pool holds {os.fstat(fd).st_size} bytes, not {nbytes}")
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def _register(buffer: torch.Tensor) -> None:
    """Page-locks `buffer` for the copy engines (what `pin_memory` does for memory CUDA allocates)."""
    nbytes = buffer.numel() * buffer.element_size()
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {nbytes / 2**30:.1f} GiB host pool failed: error {int(err)}")


def host_pool_tokens(device_tokens: int, bytes_per_token: int, page_size: int, ratio: float, size_gb: float,
                     available: int | None = None, reserve: int | None = None) -> int:
    """L2 size in tokens: `size_gb` GB when > 0, else `ratio` x the L1 tokens; page-aligned.

    It must fit in the available host memory minus a reserve for the OS (`reserve`: default
    `default_reserve`): a size derived from `ratio` that does not is
    sized down to what fits, with a warning (other processes may hold the memory: a second server
    starts); an explicit `size_gb` that does not, or a room short of one page, is a ValueError."""
    tokens = int(size_gb * GB) // bytes_per_token if size_gb > 0 else int(device_tokens * ratio)
    tokens = tokens // page_size * page_size
    if tokens < page_size:
        raise ValueError(f"the host KV pool would hold {tokens} tokens, less than one page ({page_size}); "
                         "raise hicache_ratio or hicache_size")
    available = available_ram() if available is None else available
    reserve = default_reserve(available) if reserve is None else reserve
    need, room = tokens * bytes_per_token, available - reserve
    fit = max(room, 0) // bytes_per_token // page_size * page_size
    if need <= room:
        return tokens
    if size_gb > 0 or fit < page_size:
        raise ValueError(
            f"Not enough host memory for the host KV pool: it needs {need / 2**30:.2f} GiB "
            f"({tokens} tokens x {bytes_per_token} B), {available / 2**30:.2f} GiB is available and "
            f"{reserve / 2**30:.2f} GiB is kept for the OS; lower hicache_ratio / hicache_size "
            "or pass hierarchical_cache=False (--disable-hierarchical-cache)")
    logger.warning("L2: hicache_ratio %g x L1 would take %.2f GiB, but %.2f GiB is available and %.2f GiB is kept "
                   "for the OS: the host KV pool is sized down to %d tokens (%.2f GiB); pass hicache_size to "
                   "insist on a size", ratio, need / 2**30, available / 2**30, reserve / 2**30, fit,
                   fit * bytes_per_token / 2**30)
    return fit


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_reserve(available: int) -> int:
    """Host memory kept for the OS and other processes: the smaller of 10 GiB and a fifth of
    physical RAM, and at most half of what is `available` (where other processes already hold
    most of the RAM, they keep half of the rest)."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(10 * 2**30, total // 5, available // 2)
