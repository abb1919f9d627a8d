"""Page allocators for the L1 pool. `PagedAllocator` lives in `tiers/base.py` so that L2
(`tiers/host/`) reuses it behind a lock without importing this room; `WindowedAllocator` adds
the second pool of a model with sliding-window layers."""
from __future__ import annotations

import torch

from hicache.tiers.base import PagedAllocator

__all__ = ["PagedAllocator", "WindowedAllocator"]


class WindowedAllocator:
    """Slots of the global layers' pool, each with a slot of the windowed layers' pool while
    its window part is held (`tiers.base.WindowedPageAllocator`).

    `alloc(n)` takes n global slots and n window slots, whole pages of both, and maps global
    page p to its window page (same offsets). `free_window(slots)` gives back the window part of
    whole global pages (a tombstone: the global slots stay held); `free(slots)` gives back both
    parts. `window_map` ([num_slots] int64, CPU) is the map, -1 where no window part is held;
    `device_map` its copy on the pool's device, which only `alloc` writes (an entry of a slot
    without its window part may name a slot since reused: kernels never read it). Only the
    scheduler thread calls these.
    """

    def __init__(self, num_pages: int, window_pages: int, page_size: int, window: int,
                 device: torch.device | str = "cpu"):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.page_size, self.window = page_size, window
        self.full = PagedAllocator(num_pages, page_size)
        self.windows = PagedAllocator(window_pages, page_size)
        self.window_map = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
        device = torch.device(device)
        self.device_map = self.window_map if device.type == "cpu" else self.window_map.to(device)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens > self.windows.num_free_tokens():
            return None
        slots = self.full.alloc(num_tokens)
        if slots is not None:
            self._map(slots, self.windows.alloc(num_tokens))
        return slots

    def restore_window(self, slots: torch.Tensor) -> bool:
        """Gives `slots` (whole pages of held global slots, none holding its window part) fresh
        window parts; False, changing nothing, when the windowed pool is short."""
        window = self.windows.alloc(slots.numel())
        if window is None:
            return False
        self._map(slots, window)
        return True

    def _map(self, slots: torch.Tensor, window: torch.Tensor) -> None:
        self.window_map[slots] = window
        if self.device_map is not self.window_map:
            pair = torch.stack([slots, window]).pin_memory().to(self.device_map.device, non_blocking=True)
            self.device_map[pair[0]] = pair[1]

    def free(self, slots: torch.Tensor) -> None:
        self.free_window(slots)
        self.full.free(slots)

    def free_window(self, slots: torch.Tensor) -> None:
        """Gives back the window part of `slots` (whole pages) where they hold one."""
        if slots.numel() == 0:
            return
        window = self.window_map[slots]
        held = window >= 0
        if bool(held.any()):
            self.windows.free(window[held])
            self.window_map[slots[held]] = -1

    def window_present(self, slots: torch.Tensor) -> torch.Tensor:
        """[n] bool: which of `slots` hold their window part."""
        return self.window_map[slots] >= 0

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The window slots of `slots` (-1 where absent), int64 CPU."""
        return self.window_map[slots]

    def num_free_tokens(self) -> int:
        """Tokens `alloc` can take now: the fewer of the two pools' free slots."""
        return min(self.full.num_free_tokens(), self.windows.num_free_tokens())

    def num_free_window_tokens(self) -> int:
        return self.windows.num_free_tokens()

    def num_free_global_tokens(self) -> int:
        return self.full.num_free_tokens()

    def capacity_tokens(self) -> int:
        return self.full.capacity_tokens()

    def window_capacity_tokens(self) -> int:
        return self.windows.capacity_tokens()

    def free_slots(self) -> torch.Tensor:
        return self.full.free_slots()

    def free_window_slots(self) -> torch.Tensor:
        return self.windows.free_slots()
