"""Protocols and value types shared by the cache brain (`hicache`) and the concrete tiers.

Nothing here imports anything of ours. The cache brain sees tiers only through these
interfaces, so it can be tested on CPU with fakes.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class PageKey(NamedTuple):
    """A page's identity in storage: hex sha256 chained over the prefix (DESIGN §3)."""

    digest: str


class PageAllocator(Protocol):
    """Allocates KV slots a page at a time.

    Slots are token indices into a KV pool. `alloc(n)` takes `n` tokens (a multiple of
    `page_size`) as whole pages and returns their slot indices (int64, CPU), or None when
    fewer free pages remain. `free(slots)` gives pages back; it accepts any slot list that
    `alloc` returned, or page-aligned slices of it. Only the scheduler thread calls these.
    """

    page_size: int

    def alloc(self, num_tokens: int) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def num_free_tokens(self) -> int: ...

    def capacity_tokens(self) -> int: ...

    def free_slots(self) -> torch.Tensor:
        """Every free slot index (int64, CPU), in any order. For integrity checks, not hot paths."""
        ...


class PagedAllocator:
    """Free list of pages over `num_pages * page_size` token slots.

    Page p owns slots [p * page_size, (p + 1) * page_size). `alloc(n)` needs n to be a multiple of
    page_size and returns the slots of n / page_size pages (int64, CPU), or None when too few
    pages are free. Only the scheduler thread calls it.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives low pages first
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens % self.page_size:
            raise ValueError(f"alloc({num_tokens}) is not a multiple of page_size {self.page_size}")
        n = num_tokens // self.page_size
        if n > len(self._free_pages):
            return None
        pages = self._free_pages[len(self._free_pages) - n:]
        del self._free_pages[len(self._free_pages) - n:]
        return self._slots_of(torch.tensor(pages, dtype=torch.int64))

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise ValueError(f"free() of {slots.numel()} slots is not whole pages")
        self._free_pages.extend(slots[:: self.page_size].div(self.page_size, rounding_mode="floor").tolist())

    def num_free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def free_slots(self) -> torch.Tensor:
        return self._slots_of(torch.tensor(self._free_pages, dtype=torch.int64))

    def _slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)


class DevicePool(Protocol):
    """L1: per-layer K and V buffers indexed by slot. On a machine with no GPU the buffers
    are CPU tensors.

    `k_buffer(layer)` / `v_buffer(layer)`: [num_slots, num_kv_heads, head_dim], pool dtype.
    """

    allocator: PageAllocator
    num_layers: int

    def k_buffer(self, layer: int) -> torch.Tensor: ...

    def v_buffer(self, layer: int) -> torch.Tensor: ...

    def bytes_per_token(self) -> int: ...


class HostPool(Protocol):
    """L2: a host KV pool (pinned when CUDA is present) with its own thread-safe page allocator.

    Host slots index tokens of this pool, like device slots index L1. The layout
    (`layer_first` | `page_first`) is the pool's business; transfer engines go through
    `get_layer` / `set_layer` or a layout-aware kernel.
    """

    allocator: PageAllocator
    num_layers: int
    layout: str

    def bytes_per_token(self) -> int: ...


class TransferResult(NamedTuple):
    """A finished device <-> host transfer, as `TransferEngine.poll()` reports it."""

    ticket: int
    kind: str  # "backup" (device -> host) | "load" (host -> device)
    ok: bool
    tokens: int
    nbytes: int
    seconds: float  # from submission to completion
    error: str | None = None


class TransferEngine(Protocol):
    """Moves KV pages between L1 and L2. Only the scheduler thread calls these.

    `backup` copies all layers of `device_slots` to `host_slots` in one operation; `load` copies
    `host_slots` to `device_slots` layer by layer, calling `on_layer(i)` when layer i has landed
    (on CUDA: after recording layer i's event, so attention of layer i can wait for it alone).
    Both return a ticket at once; completion (or failure: an exception in the copy is caught and
    reported, never raised) shows up in a later `poll()`, which never blocks. Slots are [n] int64,
    CPU. The caller keeps the source and destination slots alive until the ticket completes.
    `synchronize(ticket)` blocks until that ticket is done: for the rare path that must (L1
    eviction under write_back), never for the hot path.
    """

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int: ...

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, on_layer=None) -> int: ...

    def poll(self) -> list[TransferResult]: ...

    def synchronize(self, ticket: int) -> None: ...
