"""The "torch" attention backend: the reference path (any device; the one used on CPU)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache.kernels.attention import decode_attention, extend_attention, store_kv

if TYPE_CHECKING:
    from hicache.runtime.batch import ForwardBatch


class TorchAttention:
    """Torch SDPA over K/V gathered from the pool through `batch.token_slots` / `batch.slot_table`."""

    graphs = False  # it syncs with the host

    def __init__(self, head_dim: int, scale: float | None = None, windows: tuple = ()):
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.windows = windows  # per layer: sliding window or None; () for none

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        batch = batch.for_layer(layer_id)
        k_buf, v_buf = batch.pool.k_buffer(layer_id), batch.pool.v_buffer(layer_id)
        store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        batch.wait_layer(layer_id)  # this layer's load-back from L2, if one is in flight
        window = self.windows[layer_id] if self.windows else None
        if batch.mode == "decode":
            return decode_attention(q, k_buf, v_buf, batch.slot_table, batch.seq_lens, self.scale, window)
        return extend_attention(q, k_buf, v_buf, batch.token_slots, batch.extend_lens, self.scale, window)
