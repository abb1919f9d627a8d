"""Page allocator for the L1 pool. The implementation lives in `tiers/base.py` so that L2
(`tiers/host/`) reuses it behind a lock without importing this room."""
from __future__ import annotations

from hicache.tiers.base import PagedAllocator

__all__ = ["PagedAllocator"]
