"""L1 KV pool: per-layer K and V buffers indexed by token slot."""
from __future__ import annotations

import torch

from hicache.tiers.gpu.allocator import PagedAllocator, WindowedAllocator


class DeviceKVPool:
    """Per-layer K/V buffers on the compute device (CPU tensors on a machine with no GPU).

    k_buffers[layer]: [num_slots, num_kv_heads, head_dim], `dtype`, `device`. The allocator hands
    out slots a page at a time; the attention backend writes and reads the buffers. The pool does
    not interpret K and V: a model with latent attention (MLA) keeps one latent per token in a
    pool of one head, its first half in K and its second in V.

    Given `window_layers` (the sliding-window layers, window `window`) and `window_tokens`, those
    layers' buffers hold `window_tokens` slots of their own ([window_tokens, H, D]) and the
    allocator is a `WindowedAllocator`: a token's KV in a windowed layer sits at its window slot
    (`allocator.window_slots`), which it holds only while some request or tree node keeps its
    window part.
    """

    def __init__(self, num_tokens: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 window_layers: frozenset[int] = frozenset(), window: int = 0, window_tokens: int = 0):
        num_pages = num_tokens // page_size
        self.num_layers = num_layers
        self.num_slots = num_pages * page_size
        self.window_layers = frozenset(window_layers) if window_tokens else frozenset()
        if self.window_layers:
            window_pages = max(1, window_tokens // page_size)
            self.allocator = WindowedAllocator(num_pages, window_pages, page_size, window, device)
            self.window_slots = window_pages * page_size
        else:
            self.allocator = PagedAllocator(num_pages, page_size)
            self.window_slots = 0

        def shape(layer: int) -> tuple[int, int, int]:
            return (self.window_slots if layer in self.window_layers else self.num_slots, num_kv_heads, head_dim)

        self.k_buffers = [torch.zeros(shape(i), dtype=dtype, device=device) for i in range(num_layers)]
        self.v_buffers = [torch.zeros(shape(i), dtype=dtype, device=device) for i in range(num_layers)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffers[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffers[layer]

    def bytes_per_token(self) -> int:
        """K and V bytes of one token in every layer."""
        k = self.k_buffers[0]
        return 2 * self.num_layers * k[0].numel() * k.element_size()

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes per token, for sizing the pool before it exists."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
