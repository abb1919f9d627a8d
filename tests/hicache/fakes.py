"""Fakes of the tier protocols for testing the cache brain on CPU.

Test files load this by path (see `load_fakes` in them) rather than `import fakes`, so that a
`fakes.py` in another test folder cannot shadow it.
"""
from __future__ import annotations

import random

import torch


class FakeAllocator:
    """A strict PageAllocator: a free list of `num_pages` pages of `page_size` slots.

    Unlike the real allocator it checks every free: whole pages only, each page freed once and
    only if allocated. Pages come out in a shuffled order so that tests do not depend on slots
    being contiguous.
    """

    def __init__(self, num_pages: int, page_size: int, seed: int = 0):
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages))
        random.Random(seed).shuffle(self._free)
        self._allocated: set[int] = set()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens % self.page_size:
            raise ValueError(f"alloc({num_tokens}) is not whole pages of {self.page_size}")
        n = num_tokens // self.page_size
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return self._slots_of(pages)

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1, f"free() got {slots.dtype} {tuple(slots.shape)}"
        ps = self.page_size
        assert slots.numel() % ps == 0, f"free() of {slots.numel()} slots is not whole pages"
        pages = slots.view(-1, ps)
        assert bool((pages[:, 0] % ps == 0).all()), "free() of a slice that does not start pages"
        assert torch.equal(pages - pages[:, :1], torch.arange(ps).expand_as(pages)), "free() of a non-page run"
        for page in (pages[:, 0] // ps).tolist():
            assert page in self._allocated, f"double free or foreign page {page}"
            self._allocated.remove(page)
            self._free.append(page)

    def num_free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def free_slots(self) -> torch.Tensor:
        return self._slots_of(self._free)

    def _slots_of(self, pages: list[int]) -> torch.Tensor:
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
