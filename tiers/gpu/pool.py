"""L1 KV pool: per-layer K and V buffers indexed by token slot."""
from __future__ import annotations

import torch

from hicache.tiers.gpu.allocator import PagedAllocator


class DeviceKVPool:
    """Per-layer K/V buffers on the compute device (CPU tensors on a machine with no GPU).

    k_buffers[layer]: [num_slots, num_kv_heads, head_dim], `dtype`, `device`. The allocator hands
    out slots a page at a time; the attention backend writes and reads the buffers.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        num_pages = num_tokens // page_size
        self.allocator = PagedAllocator(num_pages, page_size)
        self.num_layers = num_layers
        self.num_slots = num_pages * page_size
        shape = (self.num_slots, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffers[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffers[layer]

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return 2 * self.num_layers * k[0].numel() * k.element_size()

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes per token, for sizing the pool before it exists."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
