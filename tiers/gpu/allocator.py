"""Page allocator for the L1 pool: hands out whole pages of token slots."""
from __future__ import annotations

import torch


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
