"""Host <-> device copies that never make the host wait for the GPU's queue.

A plain `torch.tensor(values, device="cuda")` or `.to("cuda")` from pageable memory synchronizes
the stream: the host waits until every kernel queued before it has run. Overlap scheduling (the
host prepares step t+1 while the GPU runs step t) needs every copy of a step's launch to go
through pinned memory with `non_blocking=True` instead; the caching host allocator keeps a pinned
block alive until the copy that reads it has run. On CPU both are plain copies.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, queued on the current stream without a host sync."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_to(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


class HostCopy:
    """Device tensors on their way to pinned host memory: `wait()` blocks until they have landed
    (an event recorded after the copies) and returns them, on the CPU. On CPU it holds the tensors."""

    def __init__(self, tensors: Sequence[torch.Tensor | None]):
        self.event = None
        if not any(t is not None and t.is_cuda for t in tensors):
            self.tensors = list(tensors)
            return
        self.tensors = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True) for t in tensors]
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> list[torch.Tensor | None]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors
