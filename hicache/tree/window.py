"""Where a match may end when L1 keeps the windowed layers' KV apart (`tiers.base.WindowedPageAllocator`).

A token's window part (its KV in the sliding-window layers) may be gone while its global part
stays: a tombstone. A request that resumes after a prefix of L tokens reads the windowed layers'
KV of tokens L - W .. L - 1 only, so a prefix is usable on L1 when those tokens (all of them when
L < W) hold their window part, whatever lies before.
"""
from __future__ import annotations

import torch

from hicache.tiers.base import PageAllocator, window_of


def window_end(allocator: PageAllocator, slots: torch.Tensor, page_size: int) -> int:
    """The deepest page boundary L <= len(slots) (0 included) whose W preceding tokens hold
    their window part in `allocator`; len(slots) for an allocator without windows."""
    window, n = window_of(allocator), slots.numel()
    if not window or n == 0:
        return n
    present = allocator.window_present(slots).view(-1, page_size).all(1)
    absent = torch.cat([torch.zeros(1, dtype=torch.int64), (~present).long().cumsum(0)])
    ends = torch.arange(absent.numel())
    lo = (ends - -(-window // page_size)).clamp(min=0)
    ok = absent[ends] == absent[lo]
    return int(ends[ok].max()) * page_size


def window_held(allocator: PageAllocator, slots: torch.Tensor, page_size: int, end: int) -> bool:
    """Whether a prefix ending at token `end` >= len(slots), whose tokens past `slots` will hold
    their window parts (a load-back brings them), finds the rest of its window held in `slots`."""
    window = window_of(allocator)
    if not window:
        return True
    start = max(0, end - window) // page_size * page_size
    return bool(allocator.window_present(slots[start:]).all())
