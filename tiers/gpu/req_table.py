"""Request-to-token table: row r lists the KV slots of request slot r's tokens in order."""
from __future__ import annotations

import torch


class ReqToTokenTable:
    """table: [max_requests, max_context] int64 on the compute device.

    Row r, column i holds the pool slot of token i of the request that owns row r. Rows are
    handed out by `alloc()` and returned by `free()`; only the scheduler thread calls them.
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def max_context(self) -> int:
        return self.table.shape[1]

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def num_free(self) -> int:
        return len(self._free_rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        if self.table.is_cuda and not slots.is_cuda:  # from pinned memory, without waiting for the queued kernels
            slots = slots.pin_memory().to(self.table.device, non_blocking=True)
        self.table[row, start:start + slots.numel()] = slots

    def scatter(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] for every i, in one copy to the device."""
        index = torch.cat([torch.tensor([rows, cols], dtype=torch.int64), slots[None]])
        if self.table.is_cuda:
            index = index.pin_memory().to(self.table.device, non_blocking=True)
        self.table[index[0], index[1]] = index[2]

    def read(self, row: int, length: int) -> torch.Tensor:
        return self.table[row, :length]
