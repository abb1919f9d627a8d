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
